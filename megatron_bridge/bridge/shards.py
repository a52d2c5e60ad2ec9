"""The shapes-only description of a rank's shard: coordinates, model facts, row blocks.

    Shard(rank, size)   one rank's piece along the split axis (FULL: the unsplit tensor)
    Shapes              the few model facts a transform needs (heads, groups, vocab)
    Block               rows [r0, r1) (maybe a column range, maybe strided) of one HF input,
                        or rows of zeros
    out_shape           the shape a list of blocks describes
    assemble            the torch tensor a list of blocks describes (the only torch here)
    split_range, joined the arithmetic every transform shares: an even split, maximal blocks

A transform (mapping.py, stacked.py) turns HF shapes and a `Shard` into `Block`s; the online
loader `assemble`s them (torch is imported there only), the offline converter copies the
same ranges as bytes (convert/bytemove/). Kept apart from the transforms so the byte movers,
the spec and the tables speak the block vocabulary without depending on the transforms.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

Sliceable = Any  # torch.Tensor or convert.formats.safetensors_io.LazySlice: .shape, [a:b] / [a:b, c:d]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Shard:
    """Coordinates of one rank's piece along the split axis (TP, or expert-TP for experts)."""

    rank: int = 0
    size: int = 1


FULL = Shard(0, 1)


@dataclass(frozen=True)
class Shapes:
    """The few model facts the transforms need (all global, i.e. before TP splitting)."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int  # rows in the HF embedding / lm_head
    padded_vocab_size: int  # rows in megatron's (TP-padded) vocab tables


@dataclass(frozen=True)
class Block:
    """One piece of a rank-local tensor: rows [r0, r1) (and columns [c0, c1) of a 2-D
    tensor) of HF input `src`, or, with `src=None`, r1 - r0 rows of zeros.

    Strided views (GPT-OSS's stacked experts, stored transposed with gate/up interleaved):
    the input's first `lead` axes are unit axes (one expert's slab) and are dropped; with
    `transposed` a 2-D input is read as its transpose (rows are its columns); `step` takes
    every step-th row of [r0, r1). The byte copier gathers such a block in memory.

    `view`: the input's bytes read as this shape first (a reshape of the contiguous tensor),
    for a split inside each row: a stacked experts tensor [E, R, C] TP-split along dim 1 or 2
    (transformers backend's `WholeStackedExperts`) is, read as rows of one rank's piece, every tp-th row
    (`step`). The rank-local tensor is then its blocks' tensor reshaped (same bytes)."""

    src: int | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    step: int = 1
    transposed: bool = False
    lead: int = 0
    view: Shape | None = None

    @property
    def n(self) -> int:
        return len(range(self.rows[0], self.rows[1], self.step))

    @property
    def strided(self) -> bool:
        """Not a row range of the input's bytes (a transposed, stepped or reshaped view)."""
        return self.step != 1 or self.transposed or self.view is not None

    def view_shape(self, shape: Shape) -> Shape:
        """Shape of the input as this block indexes it (lead axes dropped, maybe transposed)."""
        x = self.view or tuple(shape[self.lead :])
        if self.transposed:
            if len(x) != 2:
                raise ValueError(f"a transposed block needs a 2-D input, got shape {list(shape)}")
            return (x[1], x[0])
        return x

    def of(self, x: Any) -> Any:
        """This block's rows of torch tensor `x` (its input, or where a merge puts that input),
        as a view of it: what the loader reads and what the exporter writes back."""
        x = x.reshape(self.view or tuple(x.shape[self.lead :]))
        x = (x.T if self.transposed else x)[self.rows[0] : self.rows[1] : self.step]
        return x if self.cols is None else x[:, self.cols[0] : self.cols[1]]


def out_shape(blocks: Sequence[Block], hf_shapes: Sequence[Shape]) -> Shape:
    """Shape of the tensor `blocks` describe (the transforms keep trailing shapes uniform)."""
    b = next((b for b in blocks if b.src is not None), blocks[0])
    trail = (b.cols[1] - b.cols[0],) if b.cols else b.view_shape(hf_shapes[b.src or 0])[1:]
    return (sum(x.n for x in blocks),) + trail


def assemble(blocks: Sequence[Block], hf: Sequence[Sliceable]) -> torch.Tensor:
    """The torch tensor `blocks` describe. Each block is one slice of its input, so a
    LazySlice reads only those bytes; a single block is returned as that slice (a view of
    an in-memory tensor, or the input itself if it covers all of it), without a copy."""
    import torch

    def take(b: Block):
        assert b.src is not None  # zero blocks (src None) are filled below, never taken
        t = hf[b.src]
        if b.strided or b.lead:
            return b.of(t if isinstance(t, torch.Tensor) else t[:])
        if b.cols is not None:
            return t[b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]]
        if b.rows == (0, t.shape[0]):
            return t if isinstance(t, torch.Tensor) else t[:]
        return t[b.rows[0] : b.rows[1]]

    if len(blocks) == 1 and blocks[0].src is not None:
        return take(blocks[0])
    pieces = [take(b) if b.src is not None else None for b in blocks]
    real = [p for p in pieces if p is not None]
    dtype = real[0].dtype if real else getattr(hf[0], "dtype", None) or torch.float32
    trail = out_shape(blocks, [tuple(t.shape) for t in hf])[1:]
    return torch.cat(
        [p if p is not None else torch.zeros((b.n,) + trail, dtype=dtype) for b, p in zip(blocks, pieces)], dim=0
    )


def split_range(n: int, s: Shard, what: str) -> tuple[int, int]:
    """Shard `s`'s part [a, b) of `n` rows (or columns); `n` must split evenly (`what` names
    them in the error)."""
    if n % s.size:
        raise ValueError(f"{what}: size {n} is not divisible by {s.size} shards")
    k = n // s.size
    return s.rank * k, (s.rank + 1) * k


def joined(blocks: Iterable[Block]) -> list[Block]:
    """Drop empty blocks and merge each one into its predecessor when it continues it (same
    source and columns, next rows), so every block is a maximal contiguous range."""
    out: list[Block] = []
    for b in blocks:
        if b.n <= 0:
            continue
        p = out[-1] if out else None
        plain = p is not None and not (p.strided or p.lead or b.strided or b.lead)
        if plain and p is not None and p.src == b.src and p.cols == b.cols and p.rows[1] == b.rows[0]:
            out[-1] = Block(b.src, (p.rows[0], b.rows[1]), b.cols)
        else:
            out.append(b)
    return out


__all__ = [
    "Sliceable",
    "Shape",
    "Shard",
    "FULL",
    "Shapes",
    "Block",
    "out_shape",
    "assemble",
    "split_range",
    "joined",
]
