"""The hf backend's fused tensors: one model tensor transformers concatenates from several
checkpoint tensors at load (torch-free at import).

Linear-attention hybrids keep one depthwise conv over q, k and v in memory
(`self_attn.conv1d.weight [3·D, 1, K]`: Kimi-Linear, Bailing-hybrid, OLMo-hybrid's
`linear_attn`) but their checkpoints hold `q_conv1d`, `k_conv1d`, `v_conv1d`; the model's
weight converter `Concatenate(dim=0)` fuses them, and `save_pretrained` splits them back with
its reverse op, `Chunk(dim=0)` (torch.chunk: equal pieces, the last one shorter). `fused`
reads such converters by their op types (FUSE_OPS), so a fused tensor is one table row whose
HF tensors are its pieces in order, laid out by `Concatenated`; a stacking converter is
backends/hf_experts.py's, any other one is still refused (backends/hf_meta.py).

Only a tensor that is whole on every TP rank (the kinds `replicated`, `grad_allreduce`: the
linear-attention mixers run whole, backends/hf_kinds.py) is fused here: a split one would
need each piece's own TP slice, which a plain concatenation does not say.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from megatron_bridge.backends.hf_experts import unescaped
from megatron_bridge.bridge.mapping import NotBlockwise, Transform
from megatron_bridge.bridge.shards import Block, Shapes, Shard, Sliceable

# a converter's operations (loading direction), by op type -> the dim they concatenate on;
# saving splits it back as the op's reverse (`Chunk`) does
FUSE_OPS: dict[tuple[str, ...], Callable[[Sequence[Any]], int]] = {("Concatenate",): lambda ops: ops[0].dim}
# the tensor kinds (backends/hf_plan.py) a fused tensor may have: whole on every TP rank
WHOLE_KINDS = ("replicated", "grad_allreduce")
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


def fuse_converter(converter: Any) -> tuple[str, tuple[str, ...], int] | None:
    """(target, sources, dim) of a converter that concatenates whole checkpoint tensors into one,
    else None; patterns without their leading dots."""
    ops = getattr(converter, "operations", ())
    dim_of = FUSE_OPS.get(tuple(type(o).__name__ for o in ops))
    targets, sources = list(converter.target_patterns), list(converter.source_patterns)
    if dim_of is None or len(targets) != 1 or len(sources) < 2:
        return None
    if not all(_PLAIN.match(unescaped(p)) for p in targets + sources):
        return None
    return unescaped(targets[0]), tuple(unescaped(s) for s in sources), dim_of(ops)


def fused(converters: Iterable[Any], kinds: dict[str, str]) -> dict[str, tuple[tuple[str, ...], int]]:
    """{fused tensor name: (its checkpoint names in order, the dim they join on)} (before the
    saving-direction renames), for every tensor whole on every TP rank that a fusing converter
    produces."""
    out: dict[str, tuple[tuple[str, ...], int]] = {}
    for conv in converters:
        found = fuse_converter(conv)
        if found is None:
            continue
        target, sources, dim = found
        for name, kind in kinds.items():
            if (name == target or name.endswith("." + target)) and kind in WHOLE_KINDS:
                prefix = name[: -len(target)]
                out[name] = (tuple(prefix + s for s in sources), dim)
    return out


__all__ = ["FUSE_OPS", "WHOLE_KINDS", "Concatenated", "fuse_converter", "fused"]
