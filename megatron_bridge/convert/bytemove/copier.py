"""The byte-move executor: `Copier` writes a shard's pieces (pieces.py) into an open file.

* a `Span` is copied file-to-file inside the kernel with `copy_file_range` (what `cp`
  does: the bytes never enter the process), through user space where the filesystem
  refuses it;
* a `Band` is read once into a reused buffer (the rows in between come with it) and
  written with one gathered `pwritev` per 1024 rows, straight from that buffer;
* `Zeros` are written from a zero buffer;
* a `Gather` reads the expert's slab once into a reused buffer and gathers its rows with
  stdlib `memoryview` strided slices (`strided_copy`); a `Scatter` is its inverse;
* an `Interleave` reads each part once and writes row r of every part in turn.

Buffers are reused across pieces (fresh pages are slow), and a band region read for one TP
rank serves the next. Both directions use it: direct.py (convert) and direct_export.py.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_bridge.convert.bytemove.pieces import Band, Interleave, Piece, Span
from megatron_bridge.convert.bytemove.strided import FORMATS, Gather, Mem, Scatter, strided_copy
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, read_exactly
from megatron_bridge.errors import UserError

IOV_MAX = 1024  # Linux's limit on buffers per pwritev


def _gather_write(fd: int, views: list[memoryview], at: int) -> None:
    """`views` one after another from offset `at`, IOV_MAX per pwritev."""
    for i in range(0, len(views), IOV_MAX):
        batch = views[i : i + IOV_MAX]
        want, k = sum(len(v) for v in batch), os.pwritev(fd, batch, at)
        if k != want:  # a short write: finish it piece by piece
            os.pwrite(fd, b"".join(batch)[k:], at + k)
        at += want


class Copier:
    """Writes pieces into an open output file at a given offset."""

    def __init__(self) -> None:
        self._fd = OpenFiles()
        self._in_kernel = hasattr(os, "copy_file_range")
        self._buf = bytearray()
        self._held: tuple[Path, int, int] | None = None  # which band region _buf holds
        self._parts: list[bytearray] = []  # interleave buffers
        self._out = bytearray()  # a gathered or scattered matrix
        self.on_read: Callable[[Path, int, memoryview], None] | None = None  # sees each region read
        self._zeros = bytes(2**20)

    def _read(self, path: Path | Mem, start: int, nbytes: int) -> memoryview:
        if isinstance(path, Mem):
            return path.view[start : start + nbytes]
        key = (path, start, nbytes)
        if self._held != key:  # the tp ranks of a row-parallel tensor read the same rows
            if len(self._buf) < nbytes:
                self._buf = bytearray(nbytes)
            read_exactly(self._fd(path), memoryview(self._buf)[:nbytes], start, path)
            self._held = key
            if self.on_read is not None:
                self.on_read(path, start, memoryview(self._buf)[:nbytes])
        return memoryview(self._buf)[:nbytes]

    def _span(self, p: Span, fd: int, at: int) -> None:
        done = 0
        if isinstance(p.file, Mem):
            _gather_write(fd, [p.file.view[p.start : p.start + p.nbytes]], at)
            return
        if self._in_kernel:
            try:
                while done < p.nbytes:
                    k = os.copy_file_range(self._fd(p.file), fd, p.nbytes - done, p.start + done, at + done)
                    if k == 0:
                        raise UserError(f"{p.file}: unexpected end of file at byte {p.start + done} (truncated)")
                    done += k
                return
            except OSError as e:  # other filesystems, old kernels: copy through user space
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                    raise
                self._in_kernel = False
        for a in range(done, p.nbytes, 64 * 2**20):
            n = min(64 * 2**20, p.nbytes - a)
            os.pwrite(fd, self._read(p.file, p.start + a, n), at + a)

    def band(self, p: Band, fd: int, at: int) -> None:
        region = self._read(p.file, p.start, p.region_nbytes)
        _gather_write(fd, [region[r * p.row_bytes + p.lo : r * p.row_bytes + p.hi] for r in range(p.rows)], at)

    def gather(self, p: Gather, fd: int, at: int) -> None:
        f = FORMATS[p.itemsize]
        src = self._read(p.file, p.start, p.matrix_nbytes).cast(f)
        if len(self._out) < p.nbytes:
            self._out = bytearray(p.nbytes)
        out = memoryview(self._out)[: p.nbytes]
        strided_copy(out.cast(f), src, p.shape, p.rows, p.cols, p.transposed, gather=True)
        _gather_write(fd, [out], at)

    def scatter(self, p: Scatter, fd: int, at: int) -> None:
        f = FORMATS[p.itemsize]
        if len(self._out) < p.nbytes:
            self._out = bytearray(p.nbytes)
        out = memoryview(self._out)[: p.nbytes]
        for path, start, rows, cols, transposed in p.parts:
            n = p.part_nbytes(rows, cols)
            if len(self._buf) < n:
                self._buf = bytearray(n)
            part = memoryview(self._buf)[:n]
            read_exactly(self._fd(path), part, start, path)
            self._held = None
            strided_copy(out.cast(f), part.cast(f), p.shape, rows, cols, transposed, gather=False)
        _gather_write(fd, [out], at)

    def interleave(self, p: Interleave, fd: int, at: int) -> None:
        while len(self._parts) < len(p.parts):  # one reused buffer per part (fresh pages are slow)
            self._parts.append(bytearray())
        bufs = []
        for k, (path, start, width) in enumerate(p.parts):
            if len(self._parts[k]) < p.rows * width:
                self._parts[k] = bytearray(p.rows * width)
            buf = memoryview(self._parts[k])[: p.rows * width]
            read_exactly(self._fd(path), buf, start, path)
            bufs.append((buf, width))
        cols = p.taken()
        views = [b[r * w + lo : r * w + hi] for r in range(p.rows) for (b, w), (lo, hi) in zip(bufs, cols)]
        _gather_write(fd, views, at)

    def write(
        self, ps: Sequence[Piece], fd: int, at: int, bands: Callable[[Band, int, int], None] | None = None
    ) -> int:
        """Write `ps` one after another from offset `at` of `fd`; returns the bytes written.
        `bands(piece, fd, offset)`, if given, takes the bands instead (another thread)."""
        start = at
        for p in ps:
            if isinstance(p, Span):
                self._span(p, fd, at)
            elif isinstance(p, Band):
                (bands or self.band)(p, fd, at)
            elif isinstance(p, Interleave):
                self.interleave(p, fd, at)
            elif isinstance(p, Gather):
                self.gather(p, fd, at)
            elif isinstance(p, Scatter):
                self.scatter(p, fd, at)
            else:
                for a in range(0, p.nbytes, len(self._zeros)):
                    os.pwrite(fd, memoryview(self._zeros)[: min(len(self._zeros), p.nbytes - a)], at + a)
            at += p.nbytes
        return at - start

    def close(self) -> None:
        self._fd.close()
        self._buf, self._parts, self._out = bytearray(), [], bytearray()


__all__ = ["IOV_MAX", "Copier"]
