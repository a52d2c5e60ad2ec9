"""The decoder block spec of a `BridgeSpec`: megatron's local layer specs, one private copy
per layer, edited by every feature's `layer` hook (features/).

megatron-core's `get_gpt_decoder_layer_specs(use_transformer_engine=False)` gives the dense
and MoE layer specs of the whole model (no TE, no Apex, so they build on CPU; weight names
are the local spec's on every machine, which is what the family tables speak). Each layer
gets its own deep copy — the specs are shared module globals and must never be mutated —
so a feature can vary a layer (window, rope base, NoPE, norms) by its global index. The
slice for this pipeline stage / virtual chunk is the layout's split (megatron's, as arithmetic).
"""

from __future__ import annotations

import copy
from typing import Any

from megatron_bridge.bridge.features.base import features


def all_layer_specs(spec: Any, tconfig: Any) -> list[Any]:
    """One edited ModuleSpec per global layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    shared = get_gpt_decoder_layer_specs(tconfig, use_transformer_engine=False, normalization=tconfig.normalization)
    feats = features()
    out = []
    for index, layer in enumerate(shared):
        mine = copy.deepcopy(layer)
        for feat in feats:
            feat.layer(spec, index, mine)
        out.append(mine)
    return out


def decoder_block_spec(spec: Any, tconfig: Any, layers: range):
    """The TransformerBlockSubmodules of one stage's (and virtual chunk's) global `layers`
    (`ParallelDims.stage_layers`)."""
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    block = TransformerBlockSubmodules(
        layer_specs=all_layer_specs(spec, tconfig)[layers.start : layers.stop], layer_norm=LNImpl
    )
    for feat in features():
        feat.block(spec, block)
    return block


__all__ = ["decoder_block_spec", "all_layer_specs"]
