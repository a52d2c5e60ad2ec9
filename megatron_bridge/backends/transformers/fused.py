"""The transformers backend's fused tensors: one model tensor transformers concatenates from several
checkpoint tensors at load (torch-free at import).

Linear-attention hybrids keep one depthwise conv over q, k and v in memory
(`self_attn.conv1d.weight [3·D, 1, K]`: Kimi-Linear, Bailing-hybrid, OLMo-hybrid's
`linear_attn`) but their checkpoints hold `q_conv1d`, `k_conv1d`, `v_conv1d`; the model's
weight converter `Concatenate(dim=0)` fuses them, and `save_pretrained` splits them back with
its reverse op, `Chunk(dim=0)` (torch.chunk: equal pieces, the last one shorter). `fused`
reads such converters by their op types (FUSE_OPS), so a fused tensor is one table row whose
HF tensors are its pieces in order, laid out by `Concatenated`; a stacking converter is
backends/transformers/experts.py's, any other one is still refused (backends/transformers/meta.py).

A converter may join a config-given number of pieces (`Concatenate(num_shards_attribute=...)`,
one source pattern with a `*`: Qwen4-Exp's n-gram table, saved as `ngram_embedding.shard_{i}.weight`
for i < `split_ngram_parts`); its pieces are named from the config's count.

A fused tensor is whole on every TP rank (the kinds `replicated`, `grad_allreduce`: the
linear-attention mixers run whole, backends/transformers/kinds.py), or split over TP across the dim its
pieces are joined on: a `row` tensor (columns split, Qwen4-Exp's `embedding_colwise` table) joined
along its rows is each piece's column slice, joined (`ConcatenatedColumns`). A tensor split along
the joined dim would need each piece's own TP slice, which a plain concatenation does not say.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_bridge.backends.transformers.experts import in_scope, unescaped
from megatron_bridge.bridge.mapping import NotBlockwise, Transform
from megatron_bridge.bridge.shards import Block, Shapes, Shard, Sliceable, split_range

# a converter's operations (loading direction), by op type -> the dim they concatenate on;
# saving splits it back as the op's reverse (`Chunk`) does
FUSE_OPS: dict[tuple[str, ...], Callable[[Sequence[Any]], int]] = {("Concatenate",): lambda ops: ops[0].dim}
# the tensor kinds (backends/transformers/plan.py) a fused tensor may have: whole on every TP rank, or
# its columns split (pieces joined along dim 0)
WHOLE_KINDS = ("replicated", "grad_allreduce")
COLUMN_SPLIT = "row"
_PLAIN = re.compile(r"^[\w.]+$")  # a pattern that is a literal name suffix (no regex but dots)


class Concatenated(Transform):
    """`pieces` HF tensors <-> one tensor, their concatenation along `dim`, whole on every
    rank. `merge` splits it as transformers' `Chunk(dim)` does (torch.chunk), so the export is
    what `save_pretrained` writes."""

    whole = True

    def __init__(self, pieces: int, dim: int = 0) -> None:
        self.n_hf, self.dim = pieces, dim

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> list[Block]:
        if self.dim != 0:
            raise NotBlockwise(f"{self!r}: the pieces are joined along dim {self.dim}, not in rows")
        if any(x[1:] != hf_shapes[0][1:] for x in hf_shapes):
            raise ValueError(f"{self!r}: pieces {[list(x) for x in hf_shapes]} differ past dim 0")
        return [Block(i, (0, x[0])) for i, x in enumerate(hf_shapes)]

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> Any:
        import torch

        if self.dim == 0:
            return super().shard(hf, s, shapes)
        return torch.cat([t[:] for t in hf], self.dim)

    def merge(self, shards: Sequence[Any], shapes: Shapes) -> tuple[Any, ...]:
        return tuple(t.clone() for t in shards[0].chunk(self.n_hf, self.dim))

    def __repr__(self) -> str:
        return f"Concatenated({self.n_hf}, dim={self.dim})"


class ConcatenatedColumns(Concatenated):
    """`pieces` HF tensors joined along dim 0 <-> one tensor whose columns (dim 1) split over TP:
    a rank's part is every piece's column slice, joined; `merge` joins the ranks' columns and
    splits the rows back as `Chunk(0)` does."""

    whole = False

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> list[Block]:
        if self.dim != 0 or any(len(x) != 2 for x in hf_shapes):
            raise NotBlockwise(f"{self!r}: 2-D pieces joined along dim 0 only, got {[list(x) for x in hf_shapes]}")
        if any(x[1] != hf_shapes[0][1] for x in hf_shapes):
            raise ValueError(f"{self!r}: pieces {[list(x) for x in hf_shapes]} differ past dim 0")
        cols = split_range(hf_shapes[0][1], s, "the fused tensor's columns")
        whole = cols == (0, hf_shapes[0][1])
        return [Block(i, (0, x[0]), None if whole else cols) for i, x in enumerate(hf_shapes)]

    def merge(self, shards: Sequence[Any], shapes: Shapes) -> tuple[Any, ...]:
        import torch

        return tuple(t.clone() for t in torch.cat(list(shards), 1).chunk(self.n_hf, 0))

    def __repr__(self) -> str:
        return f"ConcatenatedColumns({self.n_hf})"


def fuse_converter(converter: Any, cfg: Any = None) -> tuple[str, tuple[str, ...], int] | None:
    """(target, sources, dim) of a converter that concatenates checkpoint tensors into one, else
    None; patterns without their leading dots. A `*` source with the op's `num_shards_attribute`
    is that many pieces, read off `cfg` (its text config)."""
    ops = list(getattr(converter, "operations", ()))
    dim_of = FUSE_OPS.get(tuple(type(o).__name__ for o in ops))
    targets, sources = list(converter.target_patterns), list(converter.source_patterns)
    count = getattr(ops[0], "num_shards_attribute", None) if len(ops) == 1 else None
    if dim_of is not None and count and cfg is not None and len(sources) == 1 and "*" in sources[0]:
        n = int(getattr(cfg.get_text_config(), count))
        sources = [sources[0].replace("*", str(i)) for i in range(n)]
    elif len(sources) < 2:
        return None
    if dim_of is None or len(targets) != 1:
        return None
    if not all(_PLAIN.match(unescaped(p)) for p in targets + sources):
        return None
    return unescaped(targets[0]), tuple(unescaped(s) for s in sources), dim_of(ops)


def fused(converters: Iterable[Any], kinds: dict[str, str], cfg: Any = None) -> dict[str, tuple[tuple[str, ...], int]]:
    """{fused tensor name: (its checkpoint names in order, the dim they join on)} (before the
    saving-direction renames), for every tensor a fusing converter produces that is whole on
    every TP rank or has its columns split with rows joined (`ConcatenatedColumns`); `cfg` (the
    transformers config) counts a converter's config-given pieces."""
    out: dict[str, tuple[tuple[str, ...], int]] = {}
    for conv in converters:
        found = fuse_converter(conv, cfg)
        if found is None:
            continue
        target, sources, dim = found
        for name, kind in kinds.items():
            if (
                (name == target or name.endswith("." + target))
                and in_scope(conv, name)
                and (kind in WHOLE_KINDS or (kind == COLUMN_SPLIT and dim == 0))
            ):
                prefix = name[: -len(target)]
                out[name] = (tuple(prefix + s for s in sources), dim)
    return out


__all__ = ["COLUMN_SPLIT", "FUSE_OPS", "WHOLE_KINDS", "Concatenated", "ConcatenatedColumns", "fuse_converter", "fused"]
