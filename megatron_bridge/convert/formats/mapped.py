"""File byte ranges read in place, through short-lived memory maps: CRC-32 passes and fp8.

Every converted byte is checksummed at least once after it is copied (the manifest's
per-tensor and per-file CRC-32s), and an fp8 weight is read once to be dequantised. Read with
`pread` into a buffer, such a pass also copies every byte out of the page cache; a read-only
map of the same pages lets zlib-ng (or numpy's gather) read them where they are: a CRC-32
pass over 1.67 GB in the page cache took 0.20-0.25 s instead of 0.30-0.39 s on the 2-core box
(benchmarks/byte_passes.py; docs/benchmarks.md, "Convert at disk speed"). Maps cover one
window (`WINDOW`) at a time and are unmapped right after, so the process's RSS grows by at
most one window per thread (a whole file kept mapped would count every page it touched, the
reason the tensor readers avoid `mmap`).

A file shorter than the range (truncated) is a `UserError`, as a short read is; a file that
cannot be mapped (some FUSE and network filesystems) is read with `pread` instead.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from zlib_ng import zlib_ng

from megatron_bridge.convert.formats.safetensors_io import read_exactly
from megatron_bridge.errors import UserError

_READ_CHUNK = 8 * 2**20  # the pread fallback's buffer
WINDOW = 8 * _READ_CHUNK  # bytes mapped at a time
EACH_BYTES = 2**20  # what crc32_range's `each` sees at a time: cache-sized (and WINDOW a multiple of it)


def _check_size(fd: int, end: int, path: Path) -> None:
    size = os.fstat(fd).st_size
    if end > size:
        raise UserError(f"{path}: unexpected end of file at byte {size} (the file is truncated)")


@contextmanager
def mapped(fd: int, start: int, end: int, path: Path) -> Iterator[memoryview]:
    """Bytes [start, end) of the open file `fd` as a read-only view, valid inside the block
    (mapped in place; read into a fresh buffer where the file cannot be mapped)."""
    _check_size(fd, end, path)
    if end <= start:
        yield memoryview(b"")
        return
    base = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, end - base, offset=base, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        buf = memoryview(bytearray(end - start))
        read_exactly(fd, buf, start, path)
        yield buf
        return
    try:
        with memoryview(m) as mv, mv[start - base :] as view:
            yield view
    finally:
        m.close()


def crc32_range(
    fd: int,
    start: int,
    end: int,
    path: Path,
    value: int = 0,
    each: Callable[[memoryview], None] | None = None,
) -> int:
    """CRC-32 of bytes [start, end) of the open file `fd` (continuing `value`), a WINDOW at a
    time; `each(view)` also sees every byte in order, in views of at most EACH_BYTES, each
    starting a whole number of EACH_BYTES after `start` (so a tensor's views hold whole
    elements). A view is CRC'd and handed to `each` while it is still in the CPU's cache: over
    whole windows, the second pass read every byte from memory again (docs/benchmarks.md, "After the copies")."""
    _check_size(fd, end, path)
    for pos in range(start, end, WINDOW):
        with mapped(fd, pos, min(end, pos + WINDOW), path) as view:
            if each is None:
                value = zlib_ng.crc32(view, value)
                continue
            for at in range(0, len(view), EACH_BYTES):
                with view[at : at + EACH_BYTES] as part:
                    value = zlib_ng.crc32(part, value)
                    each(part)
    return value


def crc32_file(path: Path) -> int:
    """CRC-32 of a whole file."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return crc32_range(fd, 0, os.fstat(fd).st_size, path)
    finally:
        os.close(fd)


__all__ = ["EACH_BYTES", "WINDOW", "crc32_file", "crc32_range", "mapped"]
