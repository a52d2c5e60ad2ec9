"""A shard as byte pieces: the plan of a byte move, before anything is read or written.

`pieces` turns the blocks of a shard (`Transform.blocks`, bridge/shards.py) over source
tensors (`TensorInfo`, or a `MemInfo` held in memory) into the pieces that write it:

* `Span`: a row range, one contiguous byte range of a file (or of memory);
* `Band`: a column band, [lo, hi) bytes of each of `rows` rows (a row-parallel shard);
* `Zeros`: vocab padding rows;
* `Gather` (strided.py): a strided view of one stored matrix (GPT-OSS's stacked experts).

Export adds its own: `Interleave` (a row-parallel weight from its shards' records) and
`Scatter` (strided.py). Pieces are plain frozen values, compared in tests and run by
copier.py's `Copier`; kept apart from it so what a shard is made of can be planned and
checked without opening a file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

from megatron_bridge.convert.bytemove.strided import Gather, Mem, Scatter, matrix
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.safetensors_io import TensorInfo


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

    @property
    def region_nbytes(self) -> int:
        """The whole rows' bytes: what is read (the columns between come with it)."""
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class Zeros:
    nbytes: int


@dataclass(frozen=True)
class Interleave:
    """`rows` rows, row r being row r of every part in turn; a part is `(file, start, width)`:
    `rows` contiguous rows of `width` bytes, of which `cols[k]` = [lo, hi) are taken (None:
    the whole rows). (Export: a row-parallel weight from its shards; reshard: a column band
    of one that spans several of the source's shards.)"""

    rows: int
    parts: tuple[tuple[Path, int, int], ...]
    cols: tuple[tuple[int, int], ...] | None = None

    def taken(self) -> tuple[tuple[int, int], ...]:
        """[lo, hi) of each part's rows."""
        return self.cols if self.cols is not None else tuple((0, w) for _, _, w in self.parts)

    @property
    def nbytes(self) -> int:
        return self.rows * sum(hi - lo for lo, hi in self.taken())


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


def reads(ps: Sequence[Piece]) -> list[tuple[Path, int, int]]:
    """The file ranges (path, start, nbytes) that writing `ps` reads, in order (memory and
    zeros read nothing): what the pool announces to the kernel ahead of the copies."""
    out: list[tuple[Path, int, int]] = []
    for p in ps:
        if isinstance(p, Span) and not isinstance(p.file, Mem):
            out.append((p.file, p.start, p.nbytes))
        elif isinstance(p, Band) and not isinstance(p.file, Mem):
            out.append((p.file, p.start, p.region_nbytes))
        elif isinstance(p, Gather) and not isinstance(p.file, Mem):
            out.append((p.file, p.start, p.matrix_nbytes))
        elif isinstance(p, Interleave):
            out.extend((path, start, p.rows * width) for path, start, width in p.parts)
        elif isinstance(p, Scatter):
            out.extend((path, start, p.part_nbytes(rows, cols)) for path, start, rows, cols, _ in p.parts)
    return out


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


__all__ = ["Span", "Band", "Zeros", "Interleave", "Piece", "MemInfo", "pieces"]
