"""Asking the kernel to read file ranges into the page cache ahead of use (stdlib only).

`posix_fadvise(WILLNEED)` reads in the background, but Linux caps one call at the device's
read-ahead window (`force_page_cache_ra`: max(read_ahead_kb, max_sectors_kb), e.g. 128 KiB
to a few MiB): one call for a whole 400 MiB file read 8 MiB of it, so the start-up
read-ahead fetched 32 MB of a 1.67 GB source (docs/benchmarks.md, "Read-ahead in window
chunks"). `will_need` advises in window-sized chunks, so the whole range is queued: the
disk then reads at its full queue depth (1.67 GB in 0.5-1.1 s on the 2-core box, where
`cp`'s sequential reads ran at ~0.33 GB/s). The calls block while the device's queue is
full, so callers make them off the critical path (a forked child at start-up, the tensor
path's read-ahead thread).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

FALLBACK_WINDOW = 128 * 1024  # the kernel's default read_ahead_kb, where sysfs does not say


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


__all__ = ["FALLBACK_WINDOW", "read_ahead_files", "will_need", "window"]
