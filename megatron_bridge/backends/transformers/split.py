"""The transformers backend's split tensors: model tensors transformers cuts out of one checkpoint
tensor at load, or re-orders per head (torch-free at import).

Vision towers keep q, k and v as three linears (`attention.q_proj.weight`, ...) while their
checkpoints hold one fused tensor (`attn.qkv.weight`, CLIP's `attn.in_proj_weight`): the weight
converter `Chunk(dim=0)` cuts it into equal runs of rows, and `save_pretrained` joins them back
with its reverse op, `Concatenate(dim=0)`. Rotary vision towers (Pixtral's, Kimi-K2.5's MoonViT)
also store q and k with each head's rotary pairs interleaved, which `PermuteForRope` turns into
halves ([x0, y0, x1, y1, ...] -> [x0, x1, ...; y0, y1, ...] per head), alone or after the chunk.
`split` reads such converters by their op types (SPLIT_OPS), so each model tensor is one table row
reading its run of rows of the shared checkpoint tensor, per-head permuted (`ChunkPiece`); its
`merge` gives those rows in the checkpoint's order and the exporters join the rows that share the
tensor (`Transform.piece`). A tensor the model holds whole on every TP rank only (the vision
pieces' kinds): one split over TP is still refused (backends/transformers/meta.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from megatron_bridge.backends.transformers.fused import WHOLE_KINDS
from megatron_bridge.bridge.mapping import Transform
from megatron_bridge.bridge.shards import Block, Shapes, Shard

# a converter's operations (loading direction) that cut one checkpoint tensor into the model's
# tensors, or permute one per head, by op type
SPLIT_OPS = (("Chunk",), ("Chunk", "PermuteForRope"), ("PermuteForRope",))


class Split(NamedTuple):
    """A model tensor's place in its checkpoint tensor: that tensor's name (before the saving
    direction's renames), the tensor's place `nth` of its `pieces`, its rows [at, at + rows), and
    the heads whose rotary pairs the checkpoint interleaves (0: none)."""

    source: str
    nth: int
    pieces: int
    at: int
    rows: int
    heads: int


class ChunkPiece(Transform):
    """Rows [at, at + rows) of one HF tensor <-> a model tensor whole on every rank; with `heads`,
    each head's rows de-interleaved as transformers' `PermuteForRope` does (the model's head h is
    the checkpoint's even rows of that head, then its odd ones: strided blocks). `merge` gives the
    rows back in the checkpoint's order; a piece of `count` > 1 is joined with its siblings'."""

    whole = True

    def __init__(
        self, at: int, rows: int, index: int = 0, count: int = 1, heads: int = 0, linear: bool = False
    ) -> None:
        self.at, self.rows, self.index, self.count, self.heads = at, rows, index, count, heads
        self.adapts_whole = linear  # a linear's weight (a vision tower's q_proj): LoRA may adapt it
        self.piece = (index, count) if count > 1 else None

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> list[Block]:
        (sh,) = hf_shapes
        if sh[0] < self.at + self.rows:
            raise ValueError(f"{self!r}: the checkpoint tensor has {sh[0]} rows, not {self.at + self.rows}")
        if not self.heads:
            return [Block(0, (self.at, self.at + self.rows))]
        if self.rows % (2 * self.heads):
            raise ValueError(f"{self!r}: {self.rows} rows are not {self.heads} heads of rotary pairs")
        hd = self.rows // self.heads
        at = self.at
        return [Block(0, (at + h * hd + j, at + (h + 1) * hd), step=2) for h in range(self.heads) for j in (0, 1)]

    def merge(self, shards: Any, shapes: Shapes) -> tuple[Any, ...]:
        import torch

        t = shards[0]
        if self.heads:
            rest = tuple(t.shape[1:])
            t = t.reshape(self.heads, 2, self.rows // self.heads // 2, *rest).transpose(1, 2).reshape(self.rows, *rest)
        return (t.clone(memory_format=torch.contiguous_format),)

    def __repr__(self) -> str:
        heads = f", heads={self.heads}" if self.heads else ""
        return f"ChunkPiece(rows {self.at}:{self.at + self.rows}, {self.index + 1} of {self.count}{heads})"


def _ops(converter: Any) -> list[Any]:
    return list(getattr(converter, "operations", ()))


def _permuted(op: Any, pattern: str, cfg: Any) -> int:
    """The heads `PermuteForRope` `op` re-orders the tensor of `pattern` by (0: it leaves it)."""
    names = getattr(op, "permute_layer_names", None)
    if names is not None and not any(n in pattern for n in names):
        return 0
    key = getattr(op, "subconfig_key", None)
    sub = getattr(cfg, key, cfg) if key else cfg
    return int(getattr(sub, "num_attention_heads", 1))


def _chunk_sizes(total: int, n: int) -> list[int]:
    """torch.chunk's piece sizes of `total` rows in `n`."""
    c = -(-total // n)
    return [max(0, min(c, total - i * c)) for i in range(n)]


def split(
    converters: Iterable[Any], kinds: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]], cfg: Any
) -> dict[str, Split]:
    """{model tensor: its `Split`} for every tensor a cutting or permuting converter (SPLIT_OPS, in
    the loading direction) makes, whole on every TP rank, every sibling of its checkpoint tensor
    present and cut as `Chunk` cuts (`cfg`: the transformers config, whose sub-config gives the
    heads)."""
    found: dict[str, list[tuple[int, str, int]]] = {}  # checkpoint tensor -> (index, model tensor, heads)
    counts: dict[str, int] = {}
    taken: set[str] = set()  # one converter per tensor: the first in the saving direction's order
    for conv in reversed(list(converters)):
        ops = _ops(conv)
        kinds_of = tuple(type(o).__name__ for o in ops)
        targets, sources = list(conv.target_patterns), list(conv.source_patterns)
        if kinds_of not in SPLIT_OPS or len(sources) != 1:
            continue
        chunk = ops[0] if kinds_of[0] == "Chunk" else None
        if chunk is not None and (chunk.dim != 0 or chunk.num_shards_attribute is not None or len(targets) < 2):
            continue
        if chunk is None and len(targets) != 1:
            continue
        saving = conv.reverse_transform()
        for name, kind in kinds.items():
            if kind not in WHOLE_KINDS or name in taken:
                continue
            source, pattern = saving.rename_source_key(name)
            if pattern is None:
                continue
            taken.add(name)
            at = list(saving.source_patterns).index(pattern) if pattern in saving.source_patterns else -1
            if at < 0:
                continue
            heads = _permuted(ops[-1], targets[at] if chunk else sources[0], cfg) if kinds_of[-1] != "Chunk" else 0
            found.setdefault(source, []).append((at, name, heads))
            counts[source] = len(targets)
    out: dict[str, Split] = {}
    for source, parts in found.items():
        parts.sort()
        n = counts[source]
        if [i for i, _, _ in parts] != list(range(n)):
            continue  # a sibling missing or split over TP: left to the refusal
        rows = [shapes[name][0] for _, name, _ in parts]
        if n > 1 and (rows != _chunk_sizes(sum(rows), n) or len({shapes[p][1:] for _, p, _ in parts}) != 1):
            continue
        at = 0
        for (i, name, heads), r in zip(parts, rows):
            out[name] = Split(source, i, n, at, r, heads)
            at += r
    return out


__all__ = ["SPLIT_OPS", "ChunkPiece", "Split", "split"]
