"""Which ranks still answer: a heartbeat per rank in the launcher's store.

A rank that hangs in Python can say where it is stuck (the watchdog prints its stack); a rank
that is frozen (SIGSTOP, a hung driver call holding the GIL) or whose host vanished says
nothing, and its peers only see a collective that never completes. So each rank's thread
stamps `mbr/heartbeat/RANK` with the time every `period` seconds in the store the torchrun
agent hosts (it outlives the ranks, and ranks reach it over a connection of their own, apart
from the collectives); when a watchdog fires, the ranks whose stamp is older than a few
periods are named as silent. Off where no agent hosts a store (one process, the `deepspeed`
launcher): the watchdog then names only itself.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch

KEY = "mbr/heartbeat"


class Heartbeats:
    def __init__(self, rank: int, world: int, period: float) -> None:
        self.rank, self.world, self.period = rank, world, max(0.2, period)
        self._store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and world > 1:
            store = torch.distributed.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=max(5.0, 4 * self.period)),
            )
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._store = torch.distributed.PrefixStore(f"{KEY}/attempt_{attempt}", store)
        self._lock = threading.Lock()  # one TCPStore client, two threads (beat, silent)
        self._stop = threading.Event()
        if self._store is not None:
            self._beat()
            threading.Thread(target=self._run, name="mbr-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        with self._lock:
            self._store.set(str(self.rank), f"{time.time():.3f}")  # type: ignore[union-attr]

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._beat()
            except Exception:  # the agent is gone: the orphan watch ends this rank
                return

    def silent(self) -> list[tuple[int, float]]:
        """(rank, seconds since its last beat) of the ranks silent for more than 3 periods."""
        if self._store is None:
            return []
        now, out = time.time(), []
        try:
            with self._lock:
                stamps = {
                    r: float(self._store.get(str(r)).decode()) for r in range(self.world) if self._store.check([str(r)])
                }
        except Exception:
            return []
        for r in range(self.world):
            age = now - stamps.get(r, 0.0)
            if r != self.rank and age > 3 * self.period:
                out.append((r, age))
        return out

    def close(self) -> None:
        self._stop.set()
