"""`InFlight`: at most one background write of a kind, published at step boundaries.

An async checkpoint save (`checkpoint.async_save`) and an interval HF export
(`train.export_interval`) are both written by a thread while the next steps train and are
published collectively (`finish()`: every rank's part checked, renamed into place). The loop
treats them alike: publish as soon as every rank's writer is done (`written_everywhere()`, one
scalar all-reduce, polled at each step boundary), publish the previous one before starting the
next (one in flight: host memory and disk bandwidth for one), and publish before the job ends.
What the training thread spends on them is kept (`take_seconds`) for the metrics: the snapshot
(`start`'s `make`) apart from the waiting and publishing (`poll`, `drain`), since the first is
the step's own cost and the second means the disk is slower than the interval.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Write(Protocol):
    def written_everywhere(self) -> bool: ...


W = TypeVar("W", bound=Write)


class InFlight(Generic[W]):
    def __init__(self, publish: Callable[[W], object]) -> None:
        self._publish = publish
        self._write: W | None = None
        self._snapshot_s = self._wait_s = 0.0

    def poll(self) -> None:
        """Collective: publish the write in flight if every rank's part is written."""
        t0 = time.perf_counter()
        if self._write is not None and self._write.written_everywhere():
            self.drain()
        else:
            self._wait_s += time.perf_counter() - t0

    def start(self, make: Callable[[], W]) -> None:
        """Collective: publish the previous write (waiting for it), then start the next."""
        self.drain()
        t0 = time.perf_counter()
        self._write = make()
        self._snapshot_s += time.perf_counter() - t0

    def drain(self) -> None:
        """Collective: wait for the write in flight, if any, and publish it."""
        t0 = time.perf_counter()
        write, self._write = self._write, None
        if write is not None:
            self._publish(write)
        self._wait_s += time.perf_counter() - t0

    def take_seconds(self) -> tuple[float, float]:
        """(snapshot, wait + publish) seconds on this thread since the last call."""
        out, self._snapshot_s, self._wait_s = (self._snapshot_s, self._wait_s), 0.0, 0.0
        return out


__all__ = ["InFlight"]
