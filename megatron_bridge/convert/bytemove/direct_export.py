"""`mbr export` as byte moves: HF tensors copied out of the checkpoint's records.

The inverse of `direct.py`. A shard's blocks (`Transform.blocks`) say which rows (and, for a
row-parallel shard, which columns) of which HF tensor each stretch of the shard's record
holds, so an HF tensor is, read backwards:

* for every transform that splits rows (QKV, gate/up, column-parallel, vocab, replicated):
  row ranges of the records, each one contiguous byte range — `copy_file_range`;
* for a row-parallel weight split over TP: row r is row r of every shard in turn — the
  shards are read once and written with gathered writes (`Interleave`).
* for a stacked-experts tensor: expert by expert, each slab scattered back in memory from
  its strided blocks' records (`Scatter`; the blocks must tile the slab exactly once).

Possible when no dtype cast is asked for, every record is a plain contiguous tensor, and
for torch_dist every parameter is one chunk (what `mbr convert` writes; a checkpoint that
megatron-core saved split by TP goes through tensors). The CRC-32 of every written HF tensor
is computed from the output (page cache) on a checksum thread and checked against the
manifest: a damaged checkpoint still fails the export, after the copy instead of before.
Tensors are written by the `workers=` pool (pool.py), each into its reserved byte range.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from math import prod
from pathlib import Path

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.loader import shard_for
from megatron_bridge.bridge.shards import FULL, Block, Shape, Shapes, Shard, out_shape
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.bytemove import direct
from megatron_bridge.convert.bytemove.checksums import Checksums
from megatron_bridge.convert.bytemove.copier import Copier
from megatron_bridge.convert.bytemove.pieces import Interleave, Piece, Span, reads
from megatron_bridge.convert.bytemove.pool import WorkerPool
from megatron_bridge.convert.bytemove.strided import Scatter, matrix
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.safetensors_io import TensorInfo
from megatron_bridge.convert.formats.torch_zip import TensorRef, contiguous_stride
from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile
from megatron_bridge.convert.sources.readers import DistSource, Source, TorchSource, mismatch
from megatron_bridge.errors import UserError

Record = tuple[Path, int, tuple[int, ...]]  # (file, data offset, shape without leading unit axes)


def _record(f: LazyTorchFile, ref: TensorRef, dtype: DType, where: str, lead: int = 0) -> Record | None:
    """Where a stored tensor's bytes are, if it is a whole contiguous record of `dtype`
    (`lead`: unit axes in front, a torch_dist chunk's layer/expert position)."""
    if ref.offset or tuple(ref.stride) != contiguous_stride(ref.shape) or ref.storage.numel != prod(ref.shape):
        return None
    if ref.dtype != dtype:
        raise UserError(f"{where} is stored as {ref.dtype}, the manifest says {dtype} (damaged checkpoint)")
    path, start, _ = f.range(ref)
    return path, start, tuple(ref.shape)[lead:]


def _shards(source: DistSource | TorchSource, row: Resolved, dtype: DType) -> list[tuple[Shard, Record]] | None:
    """The records of one replica of `row`, with the shard each holds."""
    if isinstance(source, DistSource):
        loc = backend_of(source.spec).dist_location(source.spec, row.megatron)
        region = source.reader.single_chunk(loc)
        if region is None:
            return None
        item = LazyTorchFile(region.path, source.io, region.offset, region.length)
        rec = (
            _record(item, item.obj, dtype, f"{region.path} ({row.megatron})", len(loc.offsets))
            if isinstance(item.obj, TensorRef)
            else None
        )
        return None if rec is None else [(FULL, rec)]
    out = []
    for group in source.replica(row)[1]:
        if len(group) > 1:  # a tensor joined from several EP ranks' runs: not one record
            return None
        (t,) = group
        f, ref = source.ref(t)
        rec = _record(f, ref, dtype, f"{f.path} {t.chunk}/{t.local}")
        if rec is None:
            return None
        out.append((shard_for(row, source.layout, t.coords), rec))
    return out


def _pieces(
    row: Resolved, i: int, hf_shapes: list[Shape], shards: list[tuple[Shard, Record]], itemsize: int, shapes: Shapes
) -> list[Piece] | None:
    """HF tensor `i` of `row` as pieces of the shard records (None: a layout this can't copy)."""
    spans: list[tuple[Block, Path, int, int]] = []  # (block, file, start of its rows, bytes per row)
    bands: list[tuple[tuple[int, int], Block, Path, int, int]] = []  # (columns, ...as spans)
    strided: list[tuple[Block, Path, int]] = []  # (block, file, start of its rows)
    for s, (path, start, shape) in shards:
        blocks = row.mapping.transform.blocks(hf_shapes, s, shapes)
        if tuple(shape) != out_shape(blocks, hf_shapes):
            raise UserError(
                f"{path}: {row.megatron} is stored as {list(shape)}, the manifest implies "
                f"{list(out_shape(blocks, hf_shapes))} (damaged checkpoint)"
            )
        rec_row = prod(shape[1:]) * itemsize
        pos = 0
        for b in blocks:
            if b.src == i and b.strided:
                strided.append((b, path, start + pos * rec_row))
            elif b.src == i and b.cols is None:
                spans.append((b, path, start + pos * rec_row, rec_row))
            elif b.src == i and b.cols is not None:
                bands.append((b.cols, b, path, start + pos * rec_row, rec_row))
            pos += b.n
    lead = next((b.lead for b, *_ in spans + strided), 0) if not bands else 0
    if strided:
        return _scatter(hf_shapes[i], strided, itemsize) if not (spans or bands) else None
    rows = hf_shapes[i][lead]
    if spans and not bands:
        spans.sort(key=lambda x: x[0].rows[0])
        ends = [0] + [b.rows[1] for b, *_ in spans]
        if any(b.rows[0] != ends[k] for k, (b, *_) in enumerate(spans)) or ends[-1] != rows:
            return None  # the shards do not tile the tensor's rows exactly once
        return [Span(path, at, b.n * rec_row) for b, path, at, rec_row in spans]
    if bands and not spans:
        bands.sort(key=lambda x: x[0][0])
        if any(b.rows != (0, rows) for _, b, *_ in bands):
            return None
        return [Interleave(rows, tuple((path, at, rec_row) for _, _, path, at, rec_row in bands))]
    return None


def _scatter(shape: Shape, parts: list[tuple[Block, Path, int]], itemsize: int) -> list[Piece] | None:
    """A tensor made of strided blocks (one expert of a stacked tensor), if they tile it."""
    lead = {b.lead for b, *_ in parts}
    if len(lead) != 1:
        return None
    stored = shape[lead.pop() :]
    m = matrix(stored)
    geo = []
    for b, _, _ in parts:
        cols = b.cols or (0, m[0] if b.transposed else m[1])
        geo.append(((b.rows[0], b.rows[1], b.step), cols, b.transposed))
    if not _tiles(m, tuple(geo)):
        return None
    return [Scatter(m, itemsize, tuple((path, at, *g) for (_, path, at), g in zip(parts, geo)))]


@functools.lru_cache(maxsize=64)
def _tiles(m: tuple[int, int], geo: tuple) -> bool:
    """Whether the views `geo` ((rows, cols, transposed), ...) cover matrix `m` exactly once
    (every expert of a stacked tensor has the same geometry: checked once)."""
    seen = bytearray(m[0] * m[1])
    mark = memoryview(bytearray(b"\x01" * max(m)))
    for rows, cols, transposed in geo:
        vr, vc = (m[1], m[0]) if transposed else m
        if rows[0] < 0 or not 0 <= cols[0] <= cols[1] <= vc:
            return False
        for r in range(*rows):
            if r >= vr:
                return False
            at = (
                slice(cols[0] * m[1] + r, cols[1] * m[1], m[1])
                if transposed
                else slice(r * vc + cols[0], r * vc + cols[1])
            )
            if seen[at].count(0) != cols[1] - cols[0]:  # already covered
                return False
            seen[at] = mark[: cols[1] - cols[0]]
    return seen.count(0) == 0


class DirectExport:
    """HF tensors of a checkpoint source written straight from its records."""

    def __init__(self, source: Source, plan: dict[str, list[Piece]], workers: int = 0):
        self.source, self.plan = source, plan
        self.pool = WorkerPool(workers, Copier, "mbr-export")
        self.checksums = Checksums(threads=self.pool.workers)

    def drain(self) -> None:
        """Wait for queued writes (before their file is closed)."""
        self.pool.drain()

    @staticmethod
    def make_plan(source: Source) -> dict[str, list[Piece]] | None:
        if not direct.ENABLED or not isinstance(source, (DistSource, TorchSource)) or not source.byte_paths:
            return None
        shapes = source.shapes
        plan: dict[str, list[Piece]] = {}
        experts: dict[str, dict[int, list[Piece]]] = {}
        for row in (r for r in source.rows if r.mapping.export):
            if row.mapping.transform.piece is not None:  # rows sharing one HF tensor: merged and joined in memory
                return None
            dtypes = {source.tensors[h][1] for h in row.hf}
            if len(dtypes) != 1 or any(source.out_dtype(h) != source.tensors[h][1] for h in row.hf):
                return None
            dtype = dtypes.pop()
            shards = _shards(source, row, dtype)
            if shards is None:
                return None
            hf_shapes = row.select_shapes([source.tensors[h][0] for h in row.hf])
            for i, name in enumerate(row.hf):
                ps = _pieces(row, i, hf_shapes, shards, dtype.itemsize, shapes)
                if ps is None:
                    return None
                if row.mapping.transform.stacked:  # one expert's slab of the HF tensor
                    experts.setdefault(name, {})[row.expert or 0] = ps
                else:
                    plan[name] = ps
        for name, slabs in experts.items():  # the slabs one after another, in expert order
            if sorted(slabs) != list(range(source.tensors[name][0][0])):
                return None
            plan[name] = [p for e in sorted(slabs) for p in slabs[e]]
        return plan

    @classmethod
    @contextmanager
    def open(cls, source: Source, workers: int = 0) -> Iterator[DirectExport | None]:
        """A DirectExport if the source can be copied from (see module doc), else None. On
        success every written tensor's CRC-32 has been checked against the manifest."""
        plan = cls.make_plan(source)
        if plan is None:
            yield None
            return
        d = cls(source, plan, workers)
        try:
            yield d
            d.drain()
            bad = sorted(n for n, crc in d.checksums.result().items() if crc != source.expected[n])
            if bad:
                raise mismatch(source.where, bad[0])
        finally:
            d.pool.close()  # then its copiers; on failure the files are still open
            d.checksums.abandon()

    def write(self, name: str, fd: int, at: int, out_path) -> int:
        """HF tensor `name` at offset `at` of `fd` (the file `out_path`), then its checksum
        from there (after the bytes are written, whichever thread writes them); returns the
        bytes it writes (queued: written by the time `drain()` returns)."""
        ps = self.plan[name]
        shape, dtype = self.source.tensors[name]
        info = TensorInfo(name, dtype, tuple(shape), out_path, at, at + sum(p.nbytes for p in ps))

        def run(copier: Copier) -> None:
            copier.write(ps, fd, at)
            self.checksums.add(info)

        self.pool.submit(name, run, info.nbytes, reads=reads(ps))
        return info.nbytes


__all__ = ["DirectExport"]
