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

The kicks run on a thread of their own: `sync_file_range` blocks while the disk's queue is
full, and on the caller's thread that stalled the conversion (a byte path waited on it longer
than it saved at the final `sync`, so early write-out was off there). Off the caller's
thread, it overlaps the disk's writing with the conversion on every path, byte moves
included (docs/benchmarks.md, "Convert at disk speed": a 1.7 GB convert is on disk 0.5-1.4 s
sooner on the 2-core box). `close()` waits for the last kick to be issued, not for the disk.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
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
    last kick get their write-out started, on the kick thread. Once a kick happened,
    `forget(path)` kicks a finished file once more and closes its fd, and `close()` (or
    leaving a `with` block) kicks what is left; an output smaller than KICK_BYTES is never
    kicked (nothing to overlap; a test suite's thousands of small conversions would
    otherwise all queue at the disk). `close()` waits for the thread. Every fd is opened,
    used and closed on the kick thread only."""

    def __init__(self, kick_bytes: int = KICK_BYTES, enabled: bool = True):
        self._fn = _sync_file_range() if enabled else None
        self._kick, self._pending = kick_bytes, 0
        self._fds: dict[Path, int] = {}  # the kick thread's
        self._dirty: set[Path] = set()  # the caller's: written since the last kick
        self._lock = threading.Lock()
        self._queued: set[Path] = set()  # handed to the kick thread, not yet kicked
        self._closing: set[Path] = set()  # ... and whose fds it then closes
        self._busy = False  # a drain task is queued or running
        self._kicked = False  # KICK_BYTES written: from then on, finished files are kicked too
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="mbr-writeback") if self._fn else None

    def wrote(self, paths: Iterable[Path], nbytes: int) -> None:
        if self._fn is None:
            return
        self._dirty.update(paths)
        self._pending += nbytes
        if self._pending >= self._kick:
            self.kick()

    def kick(self, closing: Iterable[Path] = ()) -> None:
        if self._thread is None:
            return
        self._kicked = True
        with self._lock:
            self._queued |= self._dirty
            self._closing.update(closing)
            submit, self._busy = not self._busy, True
        self._dirty.clear()
        self._pending = 0
        if submit:  # else the queued drain picks these up too: kicks never pile up behind a slow disk
            self._thread.submit(self._drain)

    def _drain(self) -> None:
        fn = self._fn
        assert fn is not None  # the thread exists only with the call
        with self._lock:
            paths, self._queued = self._queued, set()
            closing, self._closing = self._closing, set()
            self._busy = False
        for p in paths:
            fd = self._fds.get(p)
            if fd is None:
                try:
                    fd = self._fds[p] = os.open(p, os.O_RDONLY)
                except OSError:  # not on disk yet (still buffered) or already renamed: skip it
                    continue
            fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # a failure only means no early write-out
        for p in closing:
            fd = self._fds.pop(p, None)
            if fd is not None:
                os.close(fd)

    def forget(self, path: Path) -> None:
        """Stop tracking a finished file (its last pages are started, its fd closed)."""
        if self._fn is not None and self._kicked:
            self._dirty.add(path)
            self.kick(closing=(path,))

    def __enter__(self) -> Writeback:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._thread is None:
            return
        if self._kicked:  # an output under KICK_BYTES is left to the kernel (and to a test's cleanup)
            self.kick()
        self._thread.shutdown(wait=True)
        self._thread = None
        for fd in self._fds.values():  # the thread has ended: its fds are the caller's now
            os.close(fd)
        self._fds.clear()


__all__ = ["Writeback", "KICK_BYTES"]
