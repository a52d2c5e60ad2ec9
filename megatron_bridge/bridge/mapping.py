"""Layout primitives: how HF tensors become megatron shards, and back.

A `Transform` knows how one megatron tensor is laid out over its HF tensor(s) and split:

    blocks(hf_shapes, Shard(rank, size), shapes) -> [Block, ...]   shapes only, no torch
    shard(hf_tensors, Shard(rank, size), shapes) -> the rank-local megatron tensor
    merge([shard_0, ..., shard_{n-1}], shapes)   -> the HF tensors again (bit-exact)

`blocks` is the one description of the layout: a rank-local tensor is the concatenation
along dim 0 of row ranges (at most one column range) of the HF tensors and of zero rows
(vocab padding). `shard` assembles torch tensors from it (inputs may be `LazySlice`s, so a
rank reads just its part of the file); the offline converter copies the same ranges from
the safetensors bytes and validates a checkpoint on shapes alone. The megatron *global*
tensor (dist_checkpointing layout: fused QKV per query group, SwiGLU fc1 = cat([gate, up]),
padded vocab) is `shard(hf, Shard(0, 1))`, and `merge([global])` gives the HF tensors back.
Nothing here touches a model, a process group or a file. The family tables that name which
tensors use which transform live in `table.py`.
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
    every step-th row of [r0, r1). The byte copier gathers such a block in memory."""

    src: int | None
    rows: tuple[int, int]
    cols: tuple[int, int] | None = None
    step: int = 1
    transposed: bool = False
    lead: int = 0

    @property
    def n(self) -> int:
        return len(range(self.rows[0], self.rows[1], self.step))

    @property
    def strided(self) -> bool:
        """Not a row range of the input's bytes (a transposed or stepped view)."""
        return self.step != 1 or self.transposed

    def view_shape(self, shape: Shape) -> Shape:
        """Shape of the input as this block indexes it (lead axes dropped, maybe transposed)."""
        x = tuple(shape[self.lead :])
        if self.transposed:
            if len(x) != 2:
                raise ValueError(f"a transposed block needs a 2-D input, got shape {list(shape)}")
            return (x[1], x[0])
        return x


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
            x = t if isinstance(t, torch.Tensor) else t[:]
            x = x.reshape(tuple(x.shape[b.lead :]))
            x = (x.T if b.transposed else x)[b.rows[0] : b.rows[1] : b.step]
            return x if b.cols is None else x[:, b.cols[0] : b.cols[1]]
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


def _split(n: int, s: Shard, what: str) -> tuple[int, int]:
    if n % s.size:
        raise ValueError(f"{what}: size {n} is not divisible by {s.size} shards")
    k = n // s.size
    return s.rank * k, (s.rank + 1) * k


def _joined(blocks: Iterable[Block]) -> list[Block]:
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


# --------------------------------------------------------------------------------------
# Transforms. Each is stateless; the table gives it its tensors and the Shapes.
# --------------------------------------------------------------------------------------


class NotBlockwise(ValueError):
    """A layout `blocks` cannot describe (the offline byte copier refuses such a transform
    with this reason; every transform in the tables today is blockwise)."""


class Transform:
    """How one megatron tensor is built from HF tensors and split across ranks."""

    n_hf = 1  # how many HF tensors it consumes
    stacked = False  # HF tensors hold every expert along dim 0 (table rows give one expert's slab)

    def blocks(self, hf_shapes: Sequence[Shape], s: Shard, shapes: Shapes) -> list[Block]:
        """The rank-local tensor of shard `s` as blocks; raises ValueError when the shapes
        do not fit the transform or do not split into `s.size` shards."""
        hf_shapes = [tuple(x) for x in hf_shapes]
        if any(len(x) == 0 for x in hf_shapes):
            raise ValueError(f"{self!r} needs tensors with rows, got shapes {[list(x) for x in hf_shapes]}")
        return self._blocks(hf_shapes, s, shapes)

    def _blocks(self, hf_shapes: list[Shape], s: Shard, shapes: Shapes) -> list[Block]:
        raise NotImplementedError

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> torch.Tensor:
        return assemble(self.blocks([t.shape for t in hf], s, shapes), hf)

    def merge(self, shards: Sequence[torch.Tensor], shapes: Shapes) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return type(self).__name__


class Replicated(Transform):
    """Same tensor on every rank (norms, router, biases of row-parallel layers)."""

    def _blocks(self, hf_shapes, s, shapes):
        return [Block(0, (0, hf_shapes[0][0]))]

    def merge(self, shards, shapes):
        return (shards[0],)


class Column(Transform):
    """Column-parallel: output features (dim 0) split across ranks."""

    def _blocks(self, hf_shapes, s, shapes):
        return [Block(0, _split(hf_shapes[0][0], s, "column-parallel rows"))]

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(list(shards), dim=0),)


class Row(Transform):
    """Row-parallel: input features (dim 1) split across ranks. Unsplit (one shard), the
    block is plain rows: the whole tensor is one contiguous range."""

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        if len(sh) != 2:
            raise ValueError(f"row-parallel weight must be 2-D, got shape {list(sh)}")
        a, b = _split(sh[1], s, "row-parallel columns")
        return [Block(0, (0, sh[0]), None if (a, b) == (0, sh[1]) else (a, b))]

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(list(shards), dim=1),)


class VocabParallel(Transform):
    """Vocab rows split across ranks after zero-padding to `padded_vocab_size` rows."""

    def _blocks(self, hf_shapes, s, shapes):
        rows, v = hf_shapes[0][0], shapes.vocab_size
        if rows != v:
            raise ValueError(f"vocab table has {rows} rows, config says {v}")
        a, b = _split(shapes.padded_vocab_size, s, "padded vocab")
        return _joined([Block(0, (a, min(b, v))), Block(None, (max(a, v), b))])

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(list(shards), dim=0)[: shapes.vocab_size].clone(),)


class FusedQKV(Transform):
    """q, k, v projections (weights or biases) fused per query group: [q_g..., k_g, v_g].

    Megatron's linear_qkv stores, for each KV group g, that group's query heads, then its
    key head, then its value head, and TP splits those rows evenly. When TP divides the
    group count a rank holds whole groups (blocks q_g, k_g, v_g per group); when there are
    fewer KV groups than TP ranks (megatron-core >= 0.16 gathers the activations and picks
    its heads) a rank holds a fraction of one group, i.e. those pieces clipped to its rows.
    """

    n_hf = 3

    @staticmethod
    def _geometry(q, k, v, shapes):
        g, d = shapes.num_query_groups, shapes.head_dim
        hpg = shapes.num_attention_heads // g
        if q[0] != g * hpg * d or k[0] != g * d or v[0] != g * d:
            raise ValueError(
                f"q/k/v rows {q[0]}/{k[0]}/{v[0]} do not match heads="
                f"{shapes.num_attention_heads}, kv groups={g}, head_dim={d}"
            )
        if not q[1:] == k[1:] == v[1:]:
            raise ValueError(f"q/k/v shapes {list(q)}/{list(k)}/{list(v)} differ past the first dimension")
        return g, d, hpg

    def _blocks(self, hf_shapes, s, shapes):
        q, k, v = hf_shapes
        g, d, hpg = self._geometry(q, k, v, shapes)
        blk = (hpg + 2) * d
        a, b = _split(g * blk, s, "fused QKV rows")
        pieces = []
        for grp in range(a // blk, -(-b // blk)):
            at = grp * blk  # fused row where the group starts; q, k, v follow each other
            for src, start, n in ((0, grp * hpg * d, hpg * d), (1, grp * d, d), (2, grp * d, d)):
                lo, hi = max(a, at), min(b, at + n)  # this piece's part of the rank's rows
                pieces.append(Block(src, (start + lo - at, start + hi - at)))
                at += n
        return _joined(pieces)

    def merge(self, shards, shapes):
        import torch

        full = torch.cat(list(shards), dim=0)
        g, d = shapes.num_query_groups, shapes.head_dim
        hpg = shapes.num_attention_heads // g
        rest = tuple(full.shape[1:])
        grouped = full.reshape((g, (hpg + 2) * d) + rest)
        q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
        return tuple(x.reshape((-1,) + rest).clone() for x in (q, k, v))


class FusedGateUp(Transform):
    """SwiGLU fc1: each rank holds cat([gate_shard, up_shard]); global is cat([gate, up])."""

    n_hf = 2

    def _blocks(self, hf_shapes, s, shapes):
        gate, up = hf_shapes
        if gate != up:
            raise ValueError(f"gate/up shapes {list(gate)}/{list(up)} differ")
        rows = _split(gate[0], s, "gate/up rows")
        return [Block(0, rows), Block(1, rows)]

    def merge(self, shards, shapes):
        import torch

        gates, ups = zip(*(torch.chunk(x, 2, dim=0) for x in shards))
        return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


class StackedQKV(Transform):
    """One HF tensor holding [q (all heads); k; v] along its rows (Phi-3 `qkv_proj`) -> the
    per-query-group fused layout of `FusedQKV`: the same blocks, offset into the one input."""

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        q, kv = shapes.num_attention_heads * shapes.head_dim, shapes.num_query_groups * shapes.head_dim
        if sh[0] != q + 2 * kv:
            raise ValueError(f"stacked qkv has {sh[0]} rows, heads/kv groups/head_dim give {q} + 2·{kv}")
        parts = FusedQKV()._blocks([(q, *sh[1:]), (kv, *sh[1:]), (kv, *sh[1:])], s, shapes)
        at = (0, q, q + kv)  # where q, k, v start in the stacked tensor
        return _joined([Block(0, (b.rows[0] + at[b.src or 0], b.rows[1] + at[b.src or 0]), b.cols) for b in parts])

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(FusedQKV().merge(shards, shapes), dim=0),)


class StackedGateUp(Transform):
    """One HF tensor [gate; up] (Phi-3 `gate_up_proj`) -> each rank holds [gate_r; up_r], as
    `FusedGateUp`; unsplit it is the tensor itself."""

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        if sh[0] % 2:
            raise ValueError(f"stacked gate/up has an odd number of rows ({sh[0]})")
        half = sh[0] // 2
        a, b = _split(half, s, "gate/up rows")
        return _joined([Block(0, (a, b)), Block(0, (half + a, half + b))])

    def merge(self, shards, shapes):
        import torch

        return (torch.cat(FusedGateUp().merge(shards, shapes), dim=0),)


class ExpertsStacked(Transform):
    """One expert of an HF tensor that stacks all experts along dim 0 (GPT-OSS:
    `gate_up_proj` [E, in, 2·inter] with gate/up interleaved on the last dim, `down_proj`
    [E, inter, out]: stored transposed relative to nn.Linear), as megatron's per-expert
    linear. The table hands it one expert's slab [1, ...] (`Resolved.select`, a LazySlice
    reads just those bytes); `kind` says how the slab x (its unit axis dropped) becomes
    `inner`'s HF inputs:

    * "gate_up": v = x.T (weights) or x (biases); gate = v[0::2], up = v[1::2] -> GATE_UP
    * "linear": x.T (an nn.Linear weight) -> inner (ROW for down_proj)
    * "same": x itself (down_proj_bias) -> inner (REPLICATED)

    `blocks` maps `inner`'s blocks onto the slab as strided views (`Block.step`,
    `transposed`, `lead`), so `shard` (torch) and the offline byte copier share them."""

    stacked = True

    def __init__(self, inner: Transform, kind: str):
        if kind not in ("gate_up", "linear", "same"):
            raise ValueError(f"ExpertsStacked kind {kind!r}: one of gate_up, linear, same")
        self.inner, self.kind = inner, kind

    def _blocks(self, hf_shapes, s, shapes):
        (sh,) = hf_shapes
        if sh[0] != 1:
            raise ValueError(f"{self!r} takes one expert's slab [1, ...], got shape {list(sh)}")
        x = sh[1:]
        if self.kind == "same":
            return [Block(b.src, b.rows, b.cols, lead=1) for b in self.inner.blocks([x], s, shapes)]
        t = len(x) == 2  # weights are stored transposed; 1-D biases are not
        if self.kind == "linear" and not t:
            raise ValueError(f"{self!r} needs a 2-D slab [1, in, out], got shape {list(sh)}")
        v = (x[1], x[0]) if t else x
        if self.kind == "linear":
            return [Block(b.src, b.rows, b.cols, transposed=True, lead=1) for b in self.inner.blocks([v], s, shapes)]
        if v[0] % 2:
            raise ValueError(f"{self!r}: interleaved gate/up has an odd size {v[0]}")
        half = (v[0] // 2,) + v[1:]
        out = []
        for b in self.inner.blocks([half, half], s, shapes):  # src 0 = gate (even rows), 1 = up (odd)
            assert b.src is not None  # gate/up blocks never pad
            r0, r1 = b.rows
            out.append(Block(0, (2 * r0 + b.src, 2 * r1 + b.src), b.cols, step=2, transposed=t, lead=1))
        return out

    def shard(self, hf, s, shapes):
        return super().shard(hf, s, shapes).contiguous()

    def merge(self, shards, shapes):
        import torch

        parts = self.inner.merge(shards, shapes)
        if self.kind == "gate_up":
            gate, up = parts
            x = torch.stack([gate, up], dim=1).reshape((-1,) + tuple(gate.shape[1:]))
        else:
            (x,) = parts
        if self.kind != "same" and x.dim() == 2:
            x = x.T
        return (x.contiguous()[None],)

    def __repr__(self) -> str:
        return f"ExpertsStacked({self.inner!r}, {self.kind!r})"


REPLICATED, COLUMN, ROW, VOCAB = Replicated(), Column(), Row(), VocabParallel()
QKV, GATE_UP = FusedQKV(), FusedGateUp()
STACKED_QKV, STACKED_GATE_UP = StackedQKV(), StackedGateUp()


__all__ = [
    "Shard",
    "FULL",
    "Shapes",
    "Block",
    "out_shape",
    "assemble",
    "Transform",
    "Replicated",
    "Column",
    "Row",
    "VocabParallel",
    "FusedQKV",
    "FusedGateUp",
    "ExpertsStacked",
    "NotBlockwise",
    "StackedQKV",
    "StackedGateUp",
    "REPLICATED",
    "COLUMN",
    "ROW",
    "VOCAB",
    "QKV",
    "GATE_UP",
    "STACKED_QKV",
    "STACKED_GATE_UP",
]
