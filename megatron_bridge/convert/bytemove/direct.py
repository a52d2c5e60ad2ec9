"""Shards laid out straight from the safetensors bytes: the conversion as byte moves.

The bridge's transforms describe every rank-local megatron tensor as row blocks of its HF
inputs (`Transform.blocks`): a fused-QKV shard is, per KV group, a row range of q, of k
and of v; a column-parallel shard one row range; a row-parallel shard a column band of
every row; vocab padding rows of zeros. When no dtype cast is asked for, those blocks are
byte ranges of the source files, so a shard is written without building a tensor:

* a row range is one contiguous byte range, copied file-to-file inside the kernel with
  `copy_file_range` (what `cp` does: the bytes never enter the process);
* a column band is read once into a reused buffer (the rows in between come with it) and
  written with one gathered `pwritev` per 1024 rows, straight from that buffer;
* zero rows are written from a zero buffer;
* a strided block (GPT-OSS's stacked experts: transposed, gate/up interleaved) reads the
  expert's slab once into a reused buffer and gathers its rows with stdlib `memoryview`
  strided slices, one C-speed slice per row (`Gather`, `strided_copy`).

Every source tensor is still read once for its CRC-32 (the manifest's end-to-end check),
on a second thread that trails the copies, so it reads from the page cache and runs on the
other core. No torch anywhere: with the torch-free zip writer and pickler, `mbr convert`
never imports it (that import alone takes as long as copying a 1.7 GB model;
docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod
from pathlib import Path

from zlib_ng import zlib_ng

from megatron_bridge.bridge.shards import Shapes, Shard, out_shape
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.bytemove.strided import FORMATS, Gather, Mem, Scatter, matrix, strided_copy
from megatron_bridge.convert.formats import fp8
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.manifest import crc_hex
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, TensorInfo, read_exactly
from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave, TensorRef
from megatron_bridge.convert.sources.readers import HFSource
from megatron_bridge.errors import UserError

ENABLED = os.environ.get("MBR_CONVERT_DIRECT", "1") != "0"  # 0: always build tensors (for comparisons)
IOV_MAX = 1024  # Linux's limit on buffers per pwritev
CRC_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class Span:
    """`nbytes` contiguous bytes of `file` from `start`."""

    file: Path | Mem
    start: int
    nbytes: int


@dataclass(frozen=True)
class Band:
    """Of `rows` rows of `row_bytes` bytes starting at `start`, the bytes [lo, hi) of each row."""

    file: Path | Mem
    start: int
    rows: int
    row_bytes: int
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.rows * (self.hi - self.lo)


@dataclass(frozen=True)
class Zeros:
    nbytes: int


@dataclass(frozen=True)
class Interleave:
    """`rows` rows, row r being row r of every part in turn; a part is `(file, start, width)`:
    `rows` contiguous rows of `width` bytes. (Export: a row-parallel weight from its shards.)"""

    rows: int
    parts: tuple[tuple[Path, int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.rows * sum(w for _, _, w in self.parts)


Piece = Span | Band | Zeros | Interleave | Gather | Scatter


@dataclass(frozen=True)
class MemInfo:
    """A `TensorInfo` whose bytes are a `Mem` (start 0)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    file: Mem
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def pieces(blocks: Sequence, infos: Sequence[TensorInfo | MemInfo]) -> list[Piece]:
    """Byte pieces of a shard given as `Block`s over the HF tensors `infos` (see module doc)."""
    out: list[Piece] = []
    for b in blocks:
        info = infos[0 if b.src is None else b.src]
        size = info.dtype.itemsize
        stored = info.shape[b.lead :]
        row_bytes = prod(stored[1:]) * size
        r0, r1 = b.rows
        if b.src is not None and b.strided:
            m = matrix(stored)
            cols = b.cols or (0, m[0] if b.transposed else m[1])
            out.append(Gather(info.file, info.start, m, size, (r0, r1, b.step), cols, b.transposed))
        elif b.src is None:
            out.append(Zeros((r1 - r0) * row_bytes))
        elif b.cols is None:
            out.append(Span(info.file, info.start + r0 * row_bytes, (r1 - r0) * row_bytes))
        else:
            c0, c1 = b.cols
            out.append(Band(info.file, info.start + r0 * row_bytes, r1 - r0, row_bytes, c0 * size, c1 * size))
    return [p for p in out if p.nbytes]


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
        region = self._read(p.file, p.start, p.rows * p.row_bytes)
        _gather_write(fd, [region[r * p.row_bytes + p.lo : r * p.row_bytes + p.hi] for r in range(p.rows)], at)

    def gather(self, p: Gather, fd: int, at: int) -> None:
        f = FORMATS[p.itemsize]
        src = self._read(p.file, p.start, p.shape[0] * p.shape[1] * p.itemsize).cast(f)
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
            n = len(range(*rows)) * (cols[1] - cols[0]) * p.itemsize
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
        _gather_write(fd, [b[r * w : (r + 1) * w] for r in range(p.rows) for b, w in bufs], at)

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


class Checksums:
    """CRC-32 of source tensors on a worker thread, in the order they are handed in (after
    their copies: from the page cache, on the other core). `result()` waits for all."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self._q: queue.Queue[TensorInfo | None] = queue.Queue()
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._work, name="mbr-crc", daemon=True)
        self._t.start()

    def add(self, info: TensorInfo) -> None:
        if info.name not in self.values:
            self.values[info.name] = ""  # queued
            self._q.put(info)

    def _work(self) -> None:
        buf, files = bytearray(CRC_CHUNK), OpenFiles()
        try:
            while (info := self._q.get()) is not None:
                crc = 0
                for pos in range(info.start, info.end, CRC_CHUNK):
                    view = memoryview(buf)[: min(CRC_CHUNK, info.end - pos)]
                    read_exactly(files(info.file), view, pos, info.file)
                    crc = zlib_ng.crc32(view, crc)
                self.values[info.name] = crc_hex(crc)
        except BaseException as e:  # re-raised by result()
            self._error = e
            while self._q.get() is not None:
                pass
        finally:
            files.close()

    def result(self) -> dict[str, str]:
        self._q.put(None)
        self._t.join()
        if self._error is not None:
            raise self._error
        return self.values

    def abandon(self) -> None:
        self._q.put(None)
        self._t.join()


class DirectCopy:
    """Shards of an HF source written as byte moves into `StreamingTorchSave` records."""

    def __init__(self, source: HFSource):
        self.source, self.copier, self.checksums = source, Copier(), Checksums()
        # Column bands (row-parallel shards) go through user space: on a second thread,
        # with its own copier and buffer, while this one copies spans in the kernel.
        self._band_copier, self._bands = Copier(), ThreadPoolExecutor(1, thread_name_prefix="mbr-bands")
        self._pending: list[Future] = []
        # a band reads its whole source tensor into memory anyway: its CRC is taken there
        self._whole = {(i.file, i.start, i.nbytes): i.name for i in source.infos.values() if i.name not in source.quant}
        self._band_copier.on_read = self._checksum_region
        # fp8 weights of the row being written, dequantised to bf16 in memory (formats/fp8.py)
        self._mem: dict[str, MemInfo] = {}
        self._files = OpenFiles()

    def _checksum_region(self, path: Path, start: int, view: memoryview) -> None:
        name = self._whole.get((path, start, len(view)))
        if name is not None:
            self.checksums.values[name] = crc_hex(zlib_ng.crc32(view))

    def _band(self, p: Band, fd: int, at: int) -> None:
        self._pending.append(self._bands.submit(self._band_copier.band, p, fd, at))

    def drain(self) -> None:
        """Wait for the queued bands (before their files are finished and closed)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    @staticmethod
    def possible(source: object) -> bool:
        """An HF directory read without a cast (a cast needs the values, not just the bytes)."""
        return (
            ENABLED
            and isinstance(source, HFSource)
            and all(source.out_dtype(n) == dtype for n, (_, dtype) in source.tensors.items())
        )

    @classmethod
    @contextmanager
    def open(cls, source: object) -> Iterator[DirectCopy | None]:
        """A DirectCopy if `possible(source)`, else None; on success the source's checksums
        are filled in (as its own reads would have)."""
        if not cls.possible(source):
            yield None
            return
        d = cls(source)  # type: ignore[arg-type]
        try:
            yield d
            source.checksums.update(d.checksums.result())  # type: ignore[attr-defined]
        finally:
            d._bands.shutdown(wait=True, cancel_futures=True)  # on failure: the file objects are still open
            d.copier.close()
            d._band_copier.close()
            d._files.close()
            d._mem.clear()
            d.checksums.abandon()

    def shard_info(self, row: Resolved, s: Shard, shapes: Shapes) -> tuple[DType, tuple[int, ...]]:
        hf_shapes = row.select_shapes([self.source.tensors[h][0] for h in row.hf])
        return self.source.tensors[row.hf[0]][1], out_shape(
            row.mapping.transform.blocks(hf_shapes, s, shapes), hf_shapes
        )

    def _infos(self, row: Resolved) -> list[TensorInfo | MemInfo]:
        """The row's source tensors; its fp8 weights dequantised (once per row, whatever the
        number of shards; only the current row's are held, so memory is one row's bf16)."""
        quant = [h for h in row.hf if h in self.source.quant]
        if any(h not in self._mem for h in quant):
            self._mem.clear()
            self.drain()  # queued bands may still hold the previous row's buffers
            for h in quant:
                data = fp8.dequantize(self.source.quant[h], self._files)
                self.checksums.values[h] = crc_hex(zlib_ng.crc32(data))
                shape = self.source.tensors[h][0]
                self._mem[h] = MemInfo(h, self.source.tensors[h][1], shape, Mem(data), 0, len(data))
        return [self._mem[h] if h in self._mem else self.source.infos[h] for h in row.hf]

    @staticmethod
    def _select(row: Resolved, infos: list[TensorInfo | MemInfo]) -> list[TensorInfo | MemInfo]:
        """`Resolved.select` on byte ranges: a stacked-experts row reads its expert's slab."""
        e = row.expert
        if not row.mapping.transform.stacked or e is None:
            return infos
        out: list[TensorInfo | MemInfo] = []
        for i in infos:
            n = i.nbytes // i.shape[0]
            shape = (1, *i.shape[1:])
            start = i.start + e * n
            if isinstance(i, MemInfo):
                out.append(MemInfo(i.name, i.dtype, shape, i.file, start, start + n))
            else:
                out.append(TensorInfo(i.name, i.dtype, shape, i.file, start, start + n))
        return out

    def write(
        self, row: Resolved, s: Shard, shapes: Shapes, out: StreamingTorchSave, shape: tuple[int, ...] | None = None
    ) -> tuple[TensorRef, int]:
        """Shard `s` of `row` as one record of `out` (stored as `shape` if given, e.g. with
        leading unit axes); returns its reference and byte count."""
        whole = self._infos(row)
        infos = self._select(row, whole)
        hf_shapes = [i.shape for i in infos]
        blocks = row.mapping.transform.blocks(hf_shapes, s, shapes)
        shape = shape if shape is not None else out_shape(blocks, hf_shapes)
        nbytes = prod(shape) * infos[0].dtype.itemsize
        ref, at = out.reserve(nbytes, infos[0].dtype, shape)
        ps = pieces(blocks, infos)
        written = self.copier.write(ps, out.fileno(), at, self._band)
        if written != nbytes:
            raise RuntimeError(f"{row.megatron}: {written} bytes laid out for a {nbytes}-byte shard")
        banded = {(p.file, p.start, p.rows * p.row_bytes) for p in ps if isinstance(p, Band)}
        for i in whole:  # a stacked tensor's checksum covers every expert (taken once)
            if (
                isinstance(i, TensorInfo) and (i.file, i.start, i.nbytes) not in banded
            ):  # else its band job checksums it
                self.checksums.add(i)
        return ref, nbytes


__all__ = [
    "Mem",
    "MemInfo",
    "Span",
    "Band",
    "Zeros",
    "Interleave",
    "Piece",
    "pieces",
    "Copier",
    "Checksums",
    "DirectCopy",
    "ENABLED",
]
