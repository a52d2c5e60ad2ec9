"""The weight transforms: how HF tensors become megatron shards, and back.

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

This module holds the `Transform` interface and the transforms of one megatron tensor over
separate HF tensors (replicated, column/row-parallel, vocab, fused QKV, fused gate/up). The
shard vocabulary they speak (`Shard`, `Shapes`, `Block`, `assemble`) is shards.py; the
transforms of HF tensors that stack several parts in one (Phi-3's qkv/gate_up, GPT-OSS's
stacked experts) are stacked.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_bridge.bridge.shards import Block, Shape, Shapes, Shard, Sliceable, assemble, joined, split_range

if TYPE_CHECKING:
    import torch


# Each transform is stateless; the table gives it its tensors and the Shapes.


class NotBlockwise(ValueError):
    """A layout `blocks` cannot describe (the offline byte copier refuses such a transform
    with this reason; every transform in the tables today is blockwise)."""


class Transform:
    """How one megatron tensor is built from HF tensors and split across ranks."""

    n_hf = 1  # how many HF tensors it consumes
    stacked = False  # HF tensors hold every expert along dim 0 (table rows give one expert's slab)
    # `merge` uses the first shard alone (the tensor is whole on every rank): the exporter moves
    # nothing to gather it (runtime/weights_base.gather_merged)
    whole = False
    # (i, n): the row's one HF tensor is shared by n rows, this one its i-th run of rows (a fused
    # q/k/v the model holds as three tensors); `merge` gives those rows alone, and the exporters
    # put the n rows' merges together along dim 0 in i order (`join_pieces`)
    piece: tuple[int, int] | None = None
    # a linear's weight whole on every rank that a LoRA may adapt, its A and B whole too (a VLM's
    # vision tower on the transformers backend; bridge/lora.py)
    adapts_whole = False

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

    whole = True

    def _blocks(self, hf_shapes, s, shapes):
        return [Block(0, (0, hf_shapes[0][0]))]

    def merge(self, shards, shapes):
        return (shards[0],)


class WholeLinear(Replicated):
    """A linear layer's weight whole on every rank (a VLM's vision tower on the transformers
    backend): replicated, and a linear LoRA may adapt."""

    adapts_whole = True


class Scalar(Transform):
    """A 0-dim tensor (Apertus' xIELU alpha/beta), whole on every rank. It has no rows, so
    no blocks: it is read whole, and the byte copier refuses it (NotBlockwise)."""

    whole = True

    def blocks(self, hf_shapes, s, shapes):
        raise NotBlockwise(f"{self!r}: a 0-dim tensor has no rows to copy")

    def shard(self, hf, s, shapes):
        t = hf[0]
        return t if not hasattr(t, "full") else t.full()

    def merge(self, shards, shapes):
        return (shards[0],)


class Column(Transform):
    """Column-parallel: output features (dim 0) split across ranks."""

    def _blocks(self, hf_shapes, s, shapes):
        return [Block(0, split_range(hf_shapes[0][0], s, "column-parallel rows"))]

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
        a, b = split_range(sh[1], s, "row-parallel columns")
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
        a, b = split_range(shapes.padded_vocab_size, s, "padded vocab")
        return joined([Block(0, (a, min(b, v))), Block(None, (max(a, v), b))])

    def merge(self, shards, shapes):
        import torch

        # the padding cut from the shards (views) before the one concatenation: the merged table
        # is the only new memory (a cut after it would hold the shards, the padded table and its
        # copy at once: 3x the largest tensor of the weight stream, docs/rl.md "Memory")
        pieces, left = [], shapes.vocab_size
        for t in shards:
            pieces.append(t[: max(left, 0)])
            left -= t.shape[0]
        return (torch.cat(pieces, dim=0),)


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
        a, b = split_range(g * blk, s, "fused QKV rows")
        pieces = []
        for grp in range(a // blk, -(-b // blk)):
            at = grp * blk  # fused row where the group starts; q, k, v follow each other
            for src, start, n in ((0, grp * hpg * d, hpg * d), (1, grp * d, d), (2, grp * d, d)):
                lo, hi = max(a, at), min(b, at + n)  # this piece's part of the rank's rows
                pieces.append(Block(src, (start + lo - at, start + hi - at)))
                at += n
        return joined(pieces)

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
        rows = split_range(gate[0], s, "gate/up rows")
        return [Block(0, rows), Block(1, rows)]

    def merge(self, shards, shapes):
        import torch

        gates, ups = zip(*(torch.chunk(x, 2, dim=0) for x in shards))
        return torch.cat(gates, dim=0), torch.cat(ups, dim=0)


def join_pieces(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The HF tensor of the rows sharing it (`Transform.piece`), from their merges in piece order."""
    import torch

    return torch.cat(list(parts), dim=0)


REPLICATED, COLUMN, ROW, VOCAB, SCALAR = Replicated(), Column(), Row(), VocabParallel(), Scalar()
WHOLE_LINEAR = WholeLinear()
QKV, GATE_UP = FusedQKV(), FusedGateUp()


__all__ = [
    "NotBlockwise",
    "Transform",
    "Replicated",
    "Scalar",
    "Column",
    "Row",
    "VocabParallel",
    "FusedQKV",
    "FusedGateUp",
    "REPLICATED",
    "SCALAR",
    "COLUMN",
    "ROW",
    "VOCAB",
    "QKV",
    "GATE_UP",
    "join_pieces",
]
