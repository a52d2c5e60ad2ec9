"""Where each weight lives under a layout (`Layout`, i.e. `parallel.dims.ParallelDims`).

Pure functions of (spec, layout, rank coordinates): which experts an expert-parallel rank
holds, and the rank-local name (and dist_checkpointing key) of a global megatron parameter.
Which global layers a pipeline stage (and virtual chunk) holds is the layout's own
`ParallelDims.stage_layers` (megatron-core's split as arithmetic), so an offline converter
places layers exactly where a live model has them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron_bridge.parallel.dims import ParallelDims

# The bridge's name for the one layout type: same class, same fields, same rules.
Layout = ParallelDims


@dataclass(frozen=True)
class Coords:
    """One rank's place in the layout (and which virtual chunk)."""

    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    vp_stage: int | None = None

    def pre_process(self, layout: Layout) -> bool:
        return self.pp_rank == 0 and (self.vp_stage or 0) == 0

    def post_process(self, layout: Layout) -> bool:
        last_vp = (layout.vpp or 1) - 1 if layout.pp > 1 else 0
        return self.pp_rank == layout.pp - 1 and (self.vp_stage or 0) == last_vp


def megatron_degrees(layout: Layout) -> dict[str, int | None]:
    """The parallel sizes under the names Megatron-LM's `args` give them (what it reads back from
    a checkpoint's `common.pt` / rank files)."""
    return {
        "tensor_model_parallel_size": layout.tp,
        "pipeline_model_parallel_size": layout.pp,
        "virtual_pipeline_model_parallel_size": layout.vpp,
        "expert_model_parallel_size": layout.ep,
        "expert_tensor_parallel_size": layout.etp,
    }


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """Global expert indices held by expert-parallel rank `ep_rank` (contiguous blocks)."""
    if num_experts % ep:
        raise ValueError(f"{num_experts} experts do not split over ep={ep}")
    k = num_experts // ep
    return range(ep_rank * k, (ep_rank + 1) * k)


def ep_part(items: Any, ep: int, rank: int) -> Any:
    """Rank `rank`'s equal run of `items` (expert-major tensor names, or a tensor stacking
    every expert on dim 0): what an expert-parallel rank holds."""
    n = len(items) // ep
    return items[rank * n : (rank + 1) * n]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def renumber(name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """Shift the layer and local-expert indices in a megatron name by the given offsets
    (local -> global with positive offsets, global -> local with negative ones)."""
    name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


# The local spec stores its norms under fused names in dist_checkpointing (see the spec's
# `sharded_state_dict_keys_map`); an offline writer needs the checkpoint key, not the
# module attribute name.
DIST_CKPT_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


def dist_ckpt_key(megatron_name: str, fused_norm_names: bool = True) -> str:
    """`fused_norm_names=False` for multi-latent attention: megatron's MLA layer spec has no
    keys map, so its norms keep their module names in the checkpoint."""
    if not fused_norm_names:
        return megatron_name
    for a, b in DIST_CKPT_KEY_MAP:
        megatron_name = megatron_name.replace("." + a, "." + b)
    return megatron_name


def to_local_name(global_name: str, layers: range, experts: range | None = None) -> str | None:
    """Rank-local parameter name of a global one, or None if it lives elsewhere. Layer and
    expert holes are shifted; non-layer names (embedding, output) pass through."""
    m = _LAYER.match(global_name)
    if m and int(m.group(1)) not in layers:
        return None
    e = _EXPERT.search(global_name)
    if e and experts is not None and int(e.group(1)) not in experts:
        return None
    return renumber(global_name, -layers.start if m else 0, -(experts.start if (e and experts) else 0))


__all__ = [
    "Coords",
    "Layout",
    "ep_part",
    "megatron_degrees",
    "local_experts",
    "to_local_name",
    "renumber",
    "dist_ckpt_key",
]
