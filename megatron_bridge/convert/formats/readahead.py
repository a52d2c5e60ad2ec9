"""Asking the kernel to read file ranges into the page cache ahead of use (stdlib only).

`posix_fadvise(WILLNEED)` reads in the background, but Linux caps one call at the device's
read-ahead window (`force_page_cache_ra`: max(read_ahead_kb, max_sectors_kb), e.g. 128 KiB
to a few MiB): one call for a whole 400 MiB file read 8 MiB of it, so the start-up
read-ahead fetched 32 MB of a 1.67 GB source (docs/benchmarks.md, "Read-ahead in window
chunks"). `will_need` advises in window-sized chunks, so the whole range is queued: the
disk then reads at its full queue depth (1.67 GB in 0.5-1.1 s on the 2-core box, where
`cp`'s sequential reads ran at ~0.33 GB/s). The calls block while the device's queue is
full, so callers make them off the critical path: a forked child at start-up, the tensor
path's read-ahead thread, and `RollingReadAhead`'s thread for the byte paths' pool — which
keeps the disk reading beyond what the start-up read-ahead covered (a source bigger than its
budget; measured in docs/benchmarks.md, "Read-ahead in window chunks").
"""

from __future__ import annotations

import functools
import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

FALLBACK_WINDOW = 128 * 1024  # the kernel's default read_ahead_kb, where sysfs does not say
READ_AHEAD_BYTES = 512 * 2**20  # how far ahead of the reads in progress ranges are announced


@functools.cache
def window(dev: int) -> int:
    """Bytes one WILLNEED call reads on block device `dev` (st_dev): the larger of its
    read-ahead window and its largest request (a partition's limits are its disk's)."""
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue"):
        try:
            kib = max(int((queue / name).read_text()) for name in ("read_ahead_kb", "max_sectors_kb"))
        except (OSError, ValueError):
            continue
        return max(kib * 1024, 4096)
    return FALLBACK_WINDOW


def will_need(fd: int, start: int, nbytes: int) -> None:
    """Queue [start, start + nbytes) of `fd` for reading, in chunks the kernel does not cap."""
    if nbytes <= 0 or not hasattr(os, "posix_fadvise"):
        return
    step = window(os.fstat(fd).st_dev)
    for at in range(start, start + nbytes, step):
        os.posix_fadvise(fd, at, min(step, start + nbytes - at), os.POSIX_FADV_WILLNEED)


def read_ahead_files(paths: Iterable[Path], budget: int) -> None:
    """Queue `paths` for reading, in order, until `budget` bytes are asked for."""
    for p in paths:
        if budget <= 0:
            return
        fd = os.open(p, os.O_RDONLY)
        try:
            n = min(os.fstat(fd).st_size, budget)
            will_need(fd, 0, n)
        finally:
            os.close(fd)
        budget -= n


class RollingReadAhead:
    """File ranges about to be read, announced on a thread of its own, at most `ahead` bytes
    beyond what the readers have started on. `want(ranges)` (in reading order) returns the
    bytes newly announced — a range already wanted is skipped — and the reader calls
    `started(n)` with them when it begins; `close()` stops the thread (what is still queued is
    dropped: the reads it announced are no longer coming)."""

    def __init__(self, ahead: int = READ_AHEAD_BYTES):
        self._ahead = ahead
        self._cond = threading.Condition()
        self._queue: deque[tuple[Sequence[tuple[Path, int, int]], int]] = deque()
        self._seen: set[tuple[Path, int, int]] = set()
        self._announced = self._started = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mbr-read-ahead", daemon=True)
        self._thread.start()

    def want(self, ranges: Iterable[tuple[Path, int, int]]) -> int:
        new = [r for r in ranges if r[2] > 0 and r not in self._seen]
        self._seen.update(new)
        n = sum(r[2] for r in new)
        if new:
            with self._cond:
                self._queue.append((new, n))
                self._cond.notify()
        return n

    def started(self, nbytes: int) -> None:
        if nbytes:
            with self._cond:
                self._started += nbytes
                self._cond.notify()

    def _next(self) -> tuple[Sequence[tuple[Path, int, int]], int] | None:
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or (bool(self._queue) and self._announced - self._started < self._ahead)
            )
            return None if self._closed else self._queue.popleft()

    def _run(self) -> None:
        fds: dict[Path, int] = {}
        try:
            while (item := self._next()) is not None:
                for path, start, n in item[0]:
                    if path not in fds:
                        fds[path] = os.open(path, os.O_RDONLY)
                    will_need(fds[path], start, n)
                with self._cond:
                    self._announced += item[1]
        except OSError:  # a hint only: the reads themselves report a missing or unreadable file
            pass
        finally:
            for fd in fds.values():
                os.close(fd)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()


__all__ = ["FALLBACK_WINDOW", "READ_AHEAD_BYTES", "RollingReadAhead", "read_ahead_files", "will_need", "window"]
