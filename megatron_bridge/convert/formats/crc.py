"""CRC-32 of a file's byte range, read through short-lived memory maps.

Every converted byte is checksummed at least once after it is copied (the manifest's
per-tensor and per-file CRC-32s). Read with `pread` into a buffer, that pass costs a memcpy
out of the page cache per byte — on the 2-core box ~0.85 s per 1.67 GB, four times the CRC
itself (docs/benchmarks.md, "CRC passes through memory maps"). A read-only map of the same
pages lets zlib-ng read them in place (~0.22 s). Maps are one window (`WINDOW`) at a time and
unmapped right after, so the process's RSS grows by at most one window per thread (a whole
file kept mapped would count every page it touched, the reason the readers avoid `mmap`).

A file that is shorter than the range (truncated) is a `UserError`, as a short read is; a
file that cannot be mapped (some FUSE and network filesystems) is read with `pread` instead.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path

from zlib_ng import zlib_ng

from megatron_bridge.convert.formats.safetensors_io import read_exactly
from megatron_bridge.errors import UserError

_READ_CHUNK = 8 * 2**20  # the pread fallback's buffer
WINDOW = 8 * _READ_CHUNK  # bytes mapped at a time


def crc32_range(
    fd: int,
    start: int,
    end: int,
    path: Path,
    value: int = 0,
    each: Callable[[memoryview], None] | None = None,
) -> int:
    """CRC-32 of bytes [start, end) of the open file `fd` (continuing `value`); `each(view)`
    also sees every chunk in order, each starting a multiple of 8 MiB after `start` (so the
    chunks of a tensor hold whole elements)."""
    size = os.fstat(fd).st_size
    if end > size:
        raise UserError(f"{path}: unexpected end of file at byte {size} (the file is truncated)")
    gran = mmap.ALLOCATIONGRANULARITY
    pos = start
    while pos < end:
        stop = min(end, pos + WINDOW)
        base = pos - pos % gran
        try:
            m = mmap.mmap(fd, stop - base, offset=base, access=mmap.ACCESS_READ)
        except (OSError, ValueError):
            return _crc32_read(fd, pos, end, path, value, each)
        try:
            with memoryview(m) as mv, mv[pos - base :] as view:
                value = zlib_ng.crc32(view, value)
                if each is not None:
                    each(view)
        finally:
            m.close()
        pos = stop
    return value


def _crc32_read(
    fd: int, start: int, end: int, path: Path, value: int, each: Callable[[memoryview], None] | None
) -> int:
    buf = memoryview(bytearray(min(_READ_CHUNK, end - start)))
    for pos in range(start, end, _READ_CHUNK):
        view = buf[: min(_READ_CHUNK, end - pos)]
        read_exactly(fd, view, pos, path)
        value = zlib_ng.crc32(view, value)
        if each is not None:
            each(view)
    return value


def crc32_file(path: Path) -> int:
    """CRC-32 of a whole file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc32_range(fd, 0, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


__all__ = ["WINDOW", "crc32_file", "crc32_range"]
