"""Shards laid out straight from the safetensors bytes: the conversion as byte moves.

The bridge's transforms describe every rank-local megatron tensor as row blocks of its HF
inputs (`Transform.blocks`): a fused-QKV shard is, per KV group, a row range of q, of k
and of v; a column-parallel shard one row range; a row-parallel shard a column band of
every row; vocab padding rows of zeros. When no dtype cast is asked for, those blocks are
byte ranges of the source files, so a shard is written without building a tensor:
pieces.py turns the blocks into byte pieces (spans, column bands, zeros, strided gathers),
copier.py writes them (`copy_file_range`, gathered `pwritev`, a zero buffer, `memoryview`
strided slices), checksums.py takes every source tensor's CRC-32 on threads of their own.

This module is the convert direction's driver, `DirectCopy`: it decides when the byte path
applies (no cast), resolves a table row to its source tensors (an fp8 weight dequantised
in memory, a stacked-experts row to its expert's slab), reserves each shard's record in
order and hands its bytes to the `workers=` pool (pool.py: a row's shards on one worker,
with its own copier and fp8 buffers), and fills the source's checksums. No torch anywhere: with the
torch-free zip writer and pickler, `mbr convert` never imports it (that import alone takes
as long as copying a 1.7 GB model; docs/benchmarks.md).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from math import prod
from pathlib import Path

from zlib_ng import zlib_ng

from megatron_bridge.bridge.shards import Block, Shapes, Shard, out_shape
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.bytemove.checksums import Checksums
from megatron_bridge.convert.bytemove.copier import Copier
from megatron_bridge.convert.bytemove.pieces import Band, MemInfo, pieces
from megatron_bridge.convert.bytemove.pool import WorkerPool
from megatron_bridge.convert.bytemove.strided import Mem
from megatron_bridge.convert.formats import fp8
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.finite import all_finite
from megatron_bridge.convert.formats.manifest import crc_hex
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, TensorInfo
from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave, TensorRef
from megatron_bridge.convert.sources.readers import HFSource

ENABLED = os.environ.get("MBR_CONVERT_DIRECT", "1") != "0"  # 0: always build tensors (for comparisons)


class DirectCopy:
    """Shards of an HF source written as byte moves into `StreamingTorchSave` records."""

    def __init__(self, source: HFSource, workers: int = 0):
        self.source = source
        # a band reads its whole source tensor into memory anyway: its CRC is taken there
        self._whole = {(i.file, i.start, i.nbytes): i.name for i in source.infos.values() if i.name not in source.quant}
        self.pool = WorkerPool(workers, self._worker, "mbr-convert")
        self.checksums = Checksums(source.check_finite, self.pool.workers)
        self._largest_fp8 = max((2 * prod(q.shape) for q in source.quant.values()), default=0)  # as bf16

    def _worker(self) -> _Worker:
        w = _Worker()
        w.copier.on_read = self._checksum_region
        return w

    def _checksum_region(self, path: Path, start: int, view: memoryview) -> None:
        name = self._whole.get((path, start, len(view)))
        if name is not None:
            self.checksums.values[name] = crc_hex(zlib_ng.crc32(view))
            if self.checksums.check_finite and not all_finite(self.source.infos[name].dtype, view):
                self.checksums.nonfinite.add(name)

    def drain(self) -> None:
        """Wait for the queued shards (before their files are finished and closed)."""
        self.pool.drain()

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
    def open(cls, source: object, workers: int = 0) -> Iterator[DirectCopy | None]:
        """A DirectCopy if `possible(source)`, else None; on success the source's checksums
        are filled in (as its own reads would have)."""
        if not cls.possible(source):
            yield None
            return
        d = cls(source, workers)  # type: ignore[arg-type]
        try:
            yield d
            d.drain()
            source.checksums.update(d.checksums.result())  # type: ignore[attr-defined]
            source.nonfinite |= d.checksums.nonfinite  # type: ignore[attr-defined]
        finally:
            d.pool.close()  # then its workers' copiers and buffers; on failure the files are still open
            d.checksums.abandon()

    def _plan(self, row: Resolved, s: Shard, shapes: Shapes) -> tuple[DType, tuple[int, ...], list[Block]]:
        """Shard `s` of `row`: its dtype, shape and blocks (planned once, on the main thread)."""
        hf_shapes = row.select_shapes([self.source.tensors[h][0] for h in row.hf])
        blocks = row.mapping.transform.blocks(hf_shapes, s, shapes)
        return self.source.tensors[row.hf[0]][1], out_shape(blocks, hf_shapes), blocks

    def shard_info(self, row: Resolved, s: Shard, shapes: Shapes) -> tuple[DType, tuple[int, ...]]:
        return self._plan(row, s, shapes)[:2]

    def _infos(self, row: Resolved, w: _Worker) -> list[TensorInfo | MemInfo]:
        """The row's source tensors; its fp8 weights dequantised (once per row, whatever the
        number of shards: a row's shards run on one worker; each worker holds only its current
        row's, in buffers it reuses, so memory is `workers ×` one row's bf16)."""
        quant = [h for h in row.hf if h in self.source.quant]
        if any(h not in w.mem for h in quant):
            w.mem.clear()
            for k, h in enumerate(quant):
                q = self.source.quant[h]
                if len(w.bufs) <= k:  # sized once for the largest: growing one faults its pages in again
                    # anonymous memory, not bytearray(n), which zero-fills all n bytes up front
                    # (0.5 s of page faults for this benchmark's two 0.53 GB buffers per worker):
                    # a page is faulted in when first written, so only the size used costs
                    w.bufs.append(mmap.mmap(-1, max(1, self._largest_fp8)))
                data = fp8.dequantize(q, w.files, out=w.bufs[k])
                self.checksums.values[h] = crc_hex(zlib_ng.crc32(data))
                shape = self.source.tensors[h][0]
                w.mem[h] = MemInfo(h, self.source.tensors[h][1], shape, Mem(data), 0, len(data))
        return [w.mem[h] if h in w.mem else self.source.infos[h] for h in row.hf]

    def _reads(self, row: Resolved) -> list[tuple[Path, int, int]]:
        """The file ranges `row`'s shards read: its source tensors whole (an fp8 weight with
        its scales; a stacked tensor for all its experts — the pool skips a range it has
        already announced)."""
        out = []
        for h in row.hf:
            q = self.source.quant.get(h)
            for i in (q.weight, q.scale) if q is not None else (self.source.infos[h],):
                out.append((i.file, i.start, i.nbytes))
        return out

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
        leading unit axes); returns its reference and byte count. The record is reserved
        here, in order; its bytes are written by a worker (`drain()` waits for them)."""
        dtype, natural, blocks = self._plan(row, s, shapes)
        shape = shape if shape is not None else natural
        nbytes = prod(shape) * dtype.itemsize
        ref, at = out.reserve(nbytes, dtype, shape)
        fd = out.fileno()

        def run(w: _Worker) -> None:
            whole = self._infos(row, w)
            infos = self._select(row, whole)
            ps = pieces(blocks, infos)
            written = w.copier.write(ps, fd, at)
            if written != nbytes:
                raise RuntimeError(f"{row.megatron}: {written} bytes laid out for a {nbytes}-byte shard")
            banded = {(p.file, p.start, p.region_nbytes) for p in ps if isinstance(p, Band)}
            for i in whole:  # a stacked tensor's checksum covers every expert (taken once)
                if isinstance(i, TensorInfo) and (i.file, i.start, i.nbytes) not in banded:  # else the band's read did
                    self.checksums.add(i)

        self.pool.submit(row.megatron, run, nbytes, lane=out.lane, reads=self._reads(row))
        return ref, nbytes


class _Worker:
    """One pool worker's state: its copier and the dequantised fp8 tensors of its row."""

    def __init__(self) -> None:
        self.copier, self.files = Copier(), OpenFiles()
        self.mem: dict[str, MemInfo] = {}
        self.bufs: list[mmap.mmap] = []  # reused across rows: fresh pages are slow

    def close(self) -> None:
        self.copier.close()
        self.files.close()
        self.mem.clear()
        for b in self.bufs:
            try:
                b.close()
            except BufferError:  # a view still held (a failure's traceback): unmapped when it dies
                pass
        self.bufs.clear()


__all__ = ["ENABLED", "DirectCopy"]
