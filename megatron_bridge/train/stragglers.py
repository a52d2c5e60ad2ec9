"""Straggler detection: which rank makes the others wait.

In a synchronous step every rank waits for the slowest at the first collective after its own
forward-backward, so a slow rank (a throttled GPU, a busy host, a bad link) shows as *its*
compute time growing while every other rank's time waiting on peers grows. Each rank's
`StepPhases` clock splits its steps into the two; every `train.straggler_interval` steps the
ranks all-gather their sums and rank 0 compares each rank's compute time with the median of
its peers: the ranks of the same pipeline stage (stages differ in work by design), or every
other rank when the stage has only one. A rank slower than `train.straggler_factor` times
that median is named with its host on the log; `slowest_rank` and `slowest_rank_ratio` go to
the metrics at every interval (dashboards see a rank drifting before it crosses the factor).

What counts as waiting is marked by the engines (`StepPhases.waiting`): megatron-core's
gradient finalisation (the data-parallel reduction and the shared-embedding sums), DeepSpeed's
token-count reduction and its boundary backward (which holds the gradient all-reduce).
Pipeline stages' point-to-point waits stay inside forward-backward, so across stages only a
rank far off its stage's peers is named.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_bridge.runtime.groups import comm_device


class StepPhases:
    """One rank's clock over the steps since the last report: step seconds and the part of them
    spent in the engine's marked waits (collectives whose peers may be late)."""

    def __init__(self) -> None:
        self.step_s = self.wait_s = 0.0
        self.steps = 0
        self._t0: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            self.step_s += time.perf_counter() - self._t0
            self.steps += 1
            self._t0 = None

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time the block as waiting on peers, when inside a timed step (evaluation is not)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._t0 is not None:
                self.wait_s += time.perf_counter() - t

    def marked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, its calls timed as waiting (megatron-core's `finalize_model_grads_func`)."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.waiting():
                return fn(*args, **kwargs)

        return wrapper

    def take(self) -> tuple[float, float, int]:
        """(compute seconds, wait seconds, steps) since the last take; resets."""
        out = (self.step_s - self.wait_s, self.wait_s, self.steps)
        self.step_s = self.wait_s = 0.0
        self.steps = 0
        return out


def ratios(compute: list[float], stage: list[int]) -> list[float]:
    """Each rank's compute time over the median of its peers' (the other ranks of its pipeline
    stage, or all other ranks when it is alone in its stage)."""
    out = []
    for r, c in enumerate(compute):
        peers = [compute[q] for q in range(len(compute)) if q != r and stage[q] == stage[r]]
        peers = peers or [compute[q] for q in range(len(compute)) if q != r]
        mid = statistics.median(peers) if peers else c
        out.append(c / mid if mid > 0 else 1.0)
    return out


class Stragglers:
    """Every `interval` steps (0: never), a collective over the whole world: gather each rank's
    phases, and on rank 0 return the metrics and print a line naming a rank past `factor`."""

    def __init__(self, phases: StepPhases, interval: int, factor: float, *, rank: int, stage: int) -> None:
        self.phases, self.interval, self.factor, self.rank = phases, interval, factor, rank
        self.world = torch.distributed.get_world_size()
        self.who: list = [None] * self.world  # (host, pipeline stage) of every rank
        if interval:
            torch.distributed.all_gather_object(self.who, (socket.gethostname(), stage))

    def after(self, step: int) -> dict[str, float]:
        """Collective at every interval's last step; the metrics (rank 0) or {}."""
        if not self.interval or step % self.interval:
            return {}
        compute, wait, steps = self.phases.take()
        mine = torch.tensor([compute, wait, float(steps)], dtype=torch.float64, device=comm_device())
        rows = [torch.zeros_like(mine) for _ in range(self.world)]
        torch.distributed.all_gather(rows, mine)
        if self.rank != 0:
            return {}
        sums = torch.stack(rows).cpu()
        per_step = (sums[:, :2] / sums[:, 2:].clamp(min=1.0)).tolist()  # [compute, wait] s/step per rank
        rs = ratios([c for c, _ in per_step], [s for _, s in self.who])
        slow = max(range(self.world), key=lambda r: rs[r])
        if rs[slow] > self.factor:
            host, _ = self.who[slow]
            waits = statistics.median(w for r, (_, w) in enumerate(per_step) if r != slow) if self.world > 1 else 0.0
            print(
                f"straggler: rank {slow} on {host} computed {per_step[slow][0]:.3f} s/step over steps "
                f"{step - self.interval + 1}-{step}, {rs[slow]:.2f}x the median of its peers "
                f"(train.straggler_factor={self.factor:g}); the others waited {waits:.3f} s/step for it in collectives",
                flush=True,
            )
        return {"slowest_rank": float(slow), "slowest_rank_ratio": rs[slow]}


__all__ = ["StepPhases", "Stragglers", "ratios"]
