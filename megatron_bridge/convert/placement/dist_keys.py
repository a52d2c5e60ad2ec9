"""Where a model's parameter is stored in a torch_dist checkpoint (the format: `formats.dist_ckpt`).

Keys, global shapes and chunking are those of megatron-core's `GPTModel.sharded_state_dict()`
(tests/unit/convert/test_dist_ckpt_keys_families.py holds them equal for every family):

* layers of a homogeneous stack share a key with a leading layer axis,
  `decoder.layers.<name>` of shape [L, ...] (one chunk per layer — one stacked chunk loads
  several times slower); with MoE and dense layers mixed, keys keep the layer index
  (`decoder.layers.<i>.<name>`), as megatron does for non-homogeneous stacks;
* experts add an expert axis: `...mlp.experts.experts.linear_fc1.weight` [L, E, ...];
* norms use the local spec's fused names (`bridge.layout.dist_ckpt_key`);
* every linear layer in a layer has an `_extra_state` ShardedObject (value None), which a
  strict load expects.
"""

from __future__ import annotations

import re

from megatron_bridge.bridge.layout import dist_ckpt_key
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.placement.rank_files import LINEAR_MODULES
from megatron_bridge.errors import UserError

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts)\.local_experts\.(\d+)\.(.*)$")


def location(name: str, spec: BridgeSpec) -> DistLocation:
    """Where global megatron parameter `name` is stored."""
    name = dist_ckpt_key(name, fused_norm_names=not spec.multi_latent_attention)
    m = _LAYER.match(name)
    if not m:
        return DistLocation(name)
    layer, rest = int(m.group(1)), m.group(2)
    stacked = not spec.moe_layer_pattern  # megatron: moe_layer_freq as a list -> non-homogeneous layers
    key = "decoder.layers." if stacked else f"decoder.layers.{layer}."
    offsets: tuple[int, ...] = (layer,) if stacked else ()
    axes: tuple[int, ...] = (spec.num_layers,) if stacked else ()
    e = _EXPERT.match(rest)
    if e:
        if not spec.num_moe_experts:
            raise UserError(f"{name} is an expert's parameter, but the config has no experts")
        rest = f"{e.group(1)}.experts.{e.group(3)}"
        offsets, axes = offsets + (int(e.group(2)),), axes + (spec.num_moe_experts,)
    return DistLocation(key + rest, offsets, axes)


def extra_state_location(name: str, spec: BridgeSpec) -> DistLocation | None:
    """The `_extra_state` object that goes with a linear layer's weight (inside the layers)."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or module.rsplit(".", 1)[-1] not in LINEAR_MODULES or not _LAYER.match(name):
        return None
    return location(f"{module}._extra_state", spec)


__all__ = ["location", "extra_state_location"]
