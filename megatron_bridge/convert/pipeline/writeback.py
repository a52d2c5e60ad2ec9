"""Start writing converted bytes to disk while the conversion is still running.

Linux keeps written data in the page cache and flushes it only past the dirty threshold
(10 % of RAM by default) or at `sync`: a conversion smaller than that would otherwise hand
its whole output to the disk at the end, and the user (or the training job, or the next
`sync`) waits for it. `sync_file_range(SYNC_FILE_RANGE_WRITE)` asks the kernel to start
write-out of a file's dirty pages now and returns without waiting, so the disk writes
while the converter reads and transforms the next tensors. It neither waits for the disk
nor drops the pages from the cache (a training job reading the output right after still
hits memory). Not a durability promise (that is `fsync`); where the call is missing
(non-Linux) nothing happens.

Only for the tensor path, whose CPU work leaves the disk idle. The byte-move path
(`bytemove/`) keeps the disk busy itself; there the kicks stalled its copies for longer
than they saved at the final `sync` (docs/benchmarks.md, "Conversion"), so it passes
`enabled=False`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable, Iterable
from pathlib import Path

KICK_BYTES = 64 * 2**20  # start write-out every this many bytes written
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


class Writeback:
    """`wrote(paths, nbytes)` after each write; every KICK_BYTES the files written since the
    last kick get their write-out started. `close()` (or leaving a `with` block) kicks once
    more and closes the fds."""

    def __init__(self, kick_bytes: int = KICK_BYTES, enabled: bool = True):
        self._fn = _sync_file_range() if enabled else None
        self._kick, self._pending = kick_bytes, 0
        self._fds: dict[Path, int] = {}
        self._dirty: set[Path] = set()

    def wrote(self, paths: Iterable[Path], nbytes: int) -> None:
        if self._fn is None:
            return
        self._dirty.update(paths)
        self._pending += nbytes
        if self._pending >= self._kick:
            self.kick()

    def kick(self) -> None:
        fn = self._fn
        if fn is None:
            return
        for p in self._dirty:
            fd = self._fds.get(p)
            if fd is None:
                try:
                    fd = self._fds[p] = os.open(p, os.O_RDONLY)
                except OSError:  # not on disk yet (still buffered) or already renamed: skip it
                    continue
            fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure only means no early write-out
        self._dirty.clear()
        self._pending = 0

    def forget(self, path: Path) -> None:
        """Stop tracking a finished file (its last pages are started, its fd closed)."""
        if self._fn is not None:
            self._dirty.add(path)
            self.kick()
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._fn is not None and self._dirty:
            self.kick()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


__all__ = ["Writeback", "KICK_BYTES"]
