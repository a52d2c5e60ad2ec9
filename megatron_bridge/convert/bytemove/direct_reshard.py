"""`mbr reshard` as byte moves: export's pieces composed with convert's.

Read backwards (direct_export.py), each HF tensor of a checkpoint is either row ranges of its
records, one after another (`Span`s: a tensor split by rows, or not split), or one
`Interleave` (a row-parallel weight split by columns over TP). Read forwards
(`Transform.blocks`, pieces.py), a target shard is row ranges, column bands and zero rows of
the HF tensors. Composing the two gives the target shard as pieces of the source records,
without ever building the HF tensor:

* rows of a row-split tensor: the overlapping row ranges of its records — `Span`s,
  `copy_file_range` (a TP merge along dim 0 is an append, a split a byte range);
* a column band of a row-split tensor: a `Band` of each overlapping record (strided row copies);
* rows of a column-split tensor: those rows of every part, interleaved (`Interleave`);
* a column band of a column-split tensor: a `Band` of the one record it falls in, or an
  `Interleave` of the records it overlaps, each cut to its columns (`Interleave.cols`).

The tensor path keeps, whole, what this cannot do (`make_plan` declines; the writers then
read tensors): a dtype cast, records export cannot copy from (`DirectExport.make_plan`:
non-contiguous records, a torch_dist parameter in several chunks), and stacked experts (a
strided view of a strided view). Shards run on the `workers=` pool (pool.py), as in
convert; every HF tensor's CRC-32 is taken from the source records on one more thread (after
its copy: from the page cache) and checked against the manifest at the end, so a damaged
checkpoint still fails the reshard, after the copy instead of before.

Memory: each worker's buffers (one band region and the parts of one interleave, each at
most one column-split tensor) and the checksum thread's (the parts of one tensor, plus
8 MiB): about (2 x workers + 1) x the largest column-split tensor, whatever the model size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor  # the checksum thread
from contextlib import contextmanager
from math import prod
from pathlib import Path

from zlib_ng import zlib_ng

from megatron_bridge.bridge.shards import Shapes, Shard, out_shape
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.bytemove.copier import Copier
from megatron_bridge.convert.bytemove.direct_export import DirectExport
from megatron_bridge.convert.bytemove.pieces import Band, Interleave, Piece, Span, Zeros, pieces, reads
from megatron_bridge.convert.bytemove.pool import WorkerPool
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.manifest import crc_hex
from megatron_bridge.convert.formats.mapped import crc32_range
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, TensorInfo, read_exactly
from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave, TensorRef
from megatron_bridge.convert.sources.readers import CheckpointSource, mismatch

Plan = dict[str, list[Piece]]  # HF name -> its bytes as pieces of the source records


def _columns(src: Interleave, r0: int, r1: int, cols: tuple[int, int] | None) -> list[Piece]:
    """Rows [r0, r1) and byte columns `cols` (None: all) of a column-split tensor."""
    widths = [w for _, _, w in src.parts]
    lo, hi = cols if cols is not None else (0, sum(widths))
    parts, taken, x = [], [], 0
    for (path, start, w), w in zip(src.parts, widths):
        a, b = max(lo, x), min(hi, x + w)
        if a < b:
            parts.append((path, start + r0 * w, w))
            taken.append((a - x, b - x))
        x += w
    if len(parts) == 1:  # within one source shard
        (path, at, w), (a, b) = parts[0], taken[0]
        return [Span(path, at, (r1 - r0) * w) if (a, b) == (0, w) else Band(path, at, r1 - r0, w, a, b)]
    whole = all(t == (0, w) for t, (_, _, w) in zip(taken, parts))
    return [Interleave(r1 - r0, tuple(parts), None if whole else tuple(taken))]


def compose(p: Span | Band, src: Sequence[Piece], row_bytes: int) -> list[Piece]:
    """Piece `p` of an HF tensor (rows of `row_bytes` bytes, offsets from its first byte) as
    pieces of the records `src` that hold that tensor (see the module doc)."""
    r0, cols = divmod(p.start, row_bytes)[0], (p.lo, p.hi) if isinstance(p, Band) else None
    r1 = r0 + (p.rows if isinstance(p, Band) else p.nbytes // row_bytes)
    if p.start % row_bytes or (isinstance(p, Span) and p.nbytes % row_bytes):
        raise RuntimeError(f"{p} is not a row range of {row_bytes}-byte rows")
    if len(src) == 1 and isinstance(src[0], Interleave):
        return _columns(src[0], r0, r1, cols)
    out: list[Piece] = []
    a = 0
    for s in src:
        if not isinstance(s, Span):
            raise RuntimeError(f"cannot compose with {s}")
        b = a + s.nbytes // row_bytes
        x, y = max(a, r0), min(b, r1)
        if x < y:
            at = s.start + (x - a) * row_bytes
            out.append(
                Span(s.file, at, (y - x) * row_bytes) if cols is None else Band(s.file, at, y - x, row_bytes, *cols)
            )
        a = b
    return out


class DirectReshard:
    """Target shards of a checkpoint source written straight from its records."""

    def __init__(self, source: CheckpointSource, plan: Plan, workers: int = 0):
        self.source, self.plan = source, plan
        self.pool = WorkerPool(workers, Copier, "mbr-reshard")
        self._crc_pool = ThreadPoolExecutor(1, thread_name_prefix="mbr-crc")
        self._crcs: dict[str, Future] = {}
        self._crc_files = OpenFiles()
        self._crc_bufs: list[bytearray] = []  # an interleave's parts (_read)

    @staticmethod
    def make_plan(source: object) -> Plan | None:
        """Export's plan, if every HF tensor in it is row ranges or one interleave (see module doc)."""
        if not isinstance(source, CheckpointSource) or any(r.mapping.transform.stacked for r in source.rows):
            return None
        plan = DirectExport.make_plan(source)
        if plan is None:
            return None
        for ps in plan.values():
            if not (all(isinstance(p, Span) for p in ps) or (len(ps) == 1 and isinstance(ps[0], Interleave))):
                return None
        return plan

    @classmethod
    @contextmanager
    def open(cls, source: object, workers: int = 0) -> Iterator[DirectReshard | None]:
        """A DirectReshard if `make_plan` has a plan, else None; on success every source tensor
        has been checked against the manifest and the source's checksums filled in."""
        plan = cls.make_plan(source)
        if plan is None:
            yield None
            return
        d = cls(source, plan, workers)  # type: ignore[arg-type]  # make_plan: a CheckpointSource
        try:
            yield d
            d.drain()
            for name in d.source.tensors:  # every one, even if no shard needed it
                d._check(name)
            for name in sorted(d.source.tensors):
                if d._crcs[name].result() != d.source.expected[name]:
                    raise mismatch(d.source.where, name)
            d.source.checksums.update(d.source.expected)
        finally:
            d.pool.close()  # then its copiers; on failure the files are still open
            d._crc_pool.shutdown(wait=True, cancel_futures=True)
            d._crc_files.close()

    def drain(self) -> None:
        """Wait for the queued shards (before their files are finished and closed)."""
        self.pool.drain()

    def _infos(self, row: Resolved) -> list[TensorInfo]:
        """The row's HF tensors as if stored alone from byte 0 (what `compose` offsets from)."""
        out = []
        for h in row.hf:
            shape, dtype = self.source.tensors[h]
            out.append(TensorInfo(h, dtype, tuple(shape), Path(h), 0, prod(shape) * dtype.itemsize))
        return out

    def shard_info(self, row: Resolved, s: Shard, shapes: Shapes) -> tuple[DType, tuple[int, ...]]:
        infos = self._infos(row)
        hf_shapes = [i.shape for i in infos]
        return infos[0].dtype, out_shape(row.mapping.transform.blocks(hf_shapes, s, shapes), hf_shapes)

    def _pieces(self, row: Resolved, s: Shard, shapes: Shapes) -> list[Piece]:
        infos = self._infos(row)
        out: list[Piece] = []
        for b in row.mapping.transform.blocks([i.shape for i in infos], s, shapes):
            for p in pieces([b], infos):
                if isinstance(p, Zeros) or b.src is None:
                    out.append(p)
                elif isinstance(p, (Span, Band)):
                    i = infos[b.src]
                    out += compose(p, self.plan[i.name], prod(i.shape[1:]) * i.dtype.itemsize)
                else:
                    raise RuntimeError(f"{row.megatron}: {p} has no byte composition")
        return out

    def write(
        self, row: Resolved, s: Shard, shapes: Shapes, out: StreamingTorchSave, shape: tuple[int, ...] | None = None
    ) -> tuple[TensorRef, int]:
        """Shard `s` of `row` as one record of `out` (stored as `shape` if given); returns
        its reference and byte count (the same interface as `DirectCopy.write`)."""
        dtype, natural = self.shard_info(row, s, shapes)
        shape = shape if shape is not None else natural
        nbytes = prod(shape) * dtype.itemsize
        ref, at = out.reserve(nbytes, dtype, shape)
        ps, fd = self._pieces(row, s, shapes), out.fileno()
        laid = sum(p.nbytes for p in ps)
        if laid != nbytes:
            raise RuntimeError(f"{row.megatron}: {laid} bytes laid out for a {nbytes}-byte shard")
        self.pool.submit(row.megatron, lambda copier: copier.write(ps, fd, at), nbytes, lane=out.lane, reads=reads(ps))
        for h in row.hf:
            self._check(h)
        return ref, nbytes

    def _check(self, name: str) -> None:
        if name not in self._crcs:
            self._crcs[name] = self._crc_pool.submit(self._crc, self.plan[name])

    def _read(self, k: int, path: Path, start: int, n: int) -> memoryview:
        while len(self._crc_bufs) <= k:
            self._crc_bufs.append(bytearray())
        if len(self._crc_bufs[k]) < n:
            self._crc_bufs[k] = bytearray(n)
        view = memoryview(self._crc_bufs[k])[:n]
        read_exactly(self._crc_files(path), view, start, path)
        return view

    def _crc(self, ps: list[Piece]) -> str:
        """CRC-32 of an HF tensor, from its pieces in order (on the checksum thread)."""
        crc = 0
        for p in ps:
            if isinstance(p, Span):
                crc = crc32_range(self._crc_files(p.file), p.start, p.start + p.nbytes, p.file, crc)  # type: ignore[arg-type]
            elif isinstance(p, Interleave):
                bufs = [(self._read(k, path, start, p.rows * w), w) for k, (path, start, w) in enumerate(p.parts)]
                for r in range(p.rows):
                    for b, w in bufs:
                        crc = zlib_ng.crc32(b[r * w : (r + 1) * w], crc)
        return crc_hex(crc)


__all__ = ["DirectReshard", "compose"]
