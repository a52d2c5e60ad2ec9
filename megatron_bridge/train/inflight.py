"""`InFlight`: at most one background write of a kind, published at step boundaries.

An async checkpoint save (`checkpoint.async_save`) and an interval HF export
(`train.export_interval`) are both written by a thread while the next steps train and are
published collectively (`finish()`: every rank's part checked, renamed into place). The loop
treats them alike: publish as soon as every rank's writer is done (`written_everywhere()`, one
scalar all-reduce, polled at each step boundary), publish the previous one before starting the
next (one in flight: host memory and disk bandwidth for one), and publish before the job ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Write(Protocol):
    def written_everywhere(self) -> bool: ...


W = TypeVar("W", bound=Write)


class InFlight(Generic[W]):
    def __init__(self, publish: Callable[[W], object]) -> None:
        self._publish = publish
        self._write: W | None = None

    def poll(self) -> None:
        """Collective: publish the write in flight if every rank's part is written."""
        if self._write is not None and self._write.written_everywhere():
            self.drain()

    def start(self, make: Callable[[], W]) -> None:
        """Collective: publish the previous write (waiting for it), then start the next."""
        self.drain()
        self._write = make()

    def drain(self) -> None:
        """Collective: wait for the write in flight, if any, and publish it."""
        write, self._write = self._write, None
        if write is not None:
            self._publish(write)


__all__ = ["InFlight"]
