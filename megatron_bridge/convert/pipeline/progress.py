"""Progress for the conversion commands: a rich bar on a terminal, silence in CI and pipes.

The bar counts bytes (with rate and ETA) and shows tensors done in its label. Whatever the
mode, the command ends with one summary line (`summary()`): tensors, bytes, seconds, GB/s.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # rich is imported only when a bar is shown
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

MODES = ("auto", "on", "off")


class Progress:
    def __init__(self, verb: str, tensors: int, nbytes: int, mode: str = "auto"):
        if mode not in MODES:
            raise UserError(f"progress={mode!r}: choose one of {', '.join(MODES)}")
        self.verb, self.total_tensors, self.total_bytes = verb, tensors, nbytes
        self.enabled = mode == "on" or (mode == "auto" and sys.stderr.isatty() and not os.environ.get("CI"))
        self.tensors = self.bytes = 0
        self._bar: RichProgress | None = None
        self._task: TaskID | None = None
        self.start = time.perf_counter()
        self.seconds = 0.0

    def __enter__(self) -> Progress:
        self.start = time.perf_counter()
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            bar = self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            bar.__enter__()
            self._task = bar.add_task(self._label(), total=self.total_bytes)
        return self

    def _label(self) -> str:
        return f"{self.verb} {self.tensors}/{self.total_tensors} tensors"

    def advance(self, tensors: int, nbytes: int) -> None:
        self.tensors += tensors
        self.bytes += nbytes
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, advance=nbytes, description=self._label())

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def summary(self, dst: str, what: str = "") -> str:
        secs = max(self.seconds, 1e-9)
        return (
            f"{self.verb} {self.tensors} tensors, {self.bytes / 1e9:.3f} GB in {secs:.2f} s "
            f"({self.bytes / 1e9 / secs:.2f} GB/s) -> {dst}{f' ({what})' if what else ''}"
        )


__all__ = ["Progress", "MODES"]
