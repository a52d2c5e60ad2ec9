"""The decoder block spec of a `BridgeSpec`: megatron's local layer specs, one private copy
per layer, edited by every block's `layer` hook (runtime/blocks/).

megatron-core's `get_gpt_decoder_layer_specs(use_transformer_engine=False)` gives the dense
and MoE layer specs of the whole model (no TE, no Apex, so they build on CPU; weight names
are the local spec's on every machine, which is what the family tables speak). Each layer
gets its own deep copy — the specs are shared module globals and must never be mutated —
so a block can vary a layer (window, rope base, NoPE, norms) by its global index. A chunk
takes the slice of its stage split (`ParallelDims.stage_layers`).
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import LNImpl, get_gpt_decoder_layer_specs
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_bridge.runtime.blocks.base import blocks


def all_layer_specs(spec: Any, tconfig: Any) -> list[Any]:
    """One edited ModuleSpec per global layer."""
    shared = get_gpt_decoder_layer_specs(tconfig, use_transformer_engine=False, normalization=tconfig.normalization)
    hooks = blocks()
    out = []
    for index, layer in enumerate(shared):
        mine = copy.deepcopy(layer)
        for block in hooks:
            block.layer(spec, index, mine)
        out.append(mine)
    return out


def decoder_block_spec(spec: Any, tconfig: Any, layers: range):
    """The TransformerBlockSubmodules of one chunk, whose global layers are `layers`
    (`ParallelDims.stage_layers`, the one stage split)."""
    every = all_layer_specs(spec, tconfig)
    submodules = TransformerBlockSubmodules(layer_specs=every[layers.start : layers.stop], layer_norm=LNImpl)
    for block in blocks():
        block.block(spec, submodules)
    return submodules


__all__ = ["decoder_block_spec", "all_layer_specs"]
