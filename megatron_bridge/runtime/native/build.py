"""Build the megatron-core GPTModel of a `BridgeSpec` for a `Layout` (this rank's part).

The layer specs are megatron's local specs edited per layer by the bridge's building blocks
(`layer_specs.py`, `blocks/`): the core attention is Transformer Engine's where TE and
CUDA are present and compute the same thing, else `ContextParallelAttention`; the blocks
a family's config turns on (windows, norms, scalings, ...) replace or wrap modules. Weight
names are the local spec's on every machine, which is what the mapping tables speak.

`build_native` returns one GPTModel per virtual pipeline chunk (a list of one without VPP),
each with pre_process/post_process set for its stage; the blocks' `model` hooks finish it
(blocks/rope.py puts in rotary frequencies computed exactly as transformers does).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.runtime.blocks.base import blocks
from megatron_bridge.runtime.build_base import check_groups, skip_weight_init
from megatron_bridge.runtime.layer_specs import decoder_block_spec
from megatron_bridge.runtime.tconfig import gpt_model_kwargs, transformer_config


def build_native(spec: BridgeSpec, layout: Layout, *, load_weights: bool = False, **config_overrides: Any) -> list[Any]:
    """This rank's GPTModel chunks for `spec` under `layout` (groups must be initialized).

    `load_weights` and `config_overrides` as `runtime.build.build_model` says: megatron's random
    init, or none where every weight is about to be loaded."""
    check_groups(layout)
    tconfig = transformer_config(spec, layout, **config_overrides)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    vpp = tconfig.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp) if vpp else [None]:
        layers = layout.stage_layers(spec.num_layers, pp_rank, vp)
        layer_spec = decoder_block_spec(spec, tconfig, layers)
        with skip_weight_init(load_weights):
            model = GPTModel(
                config=tconfig,
                transformer_layer_spec=layer_spec,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                vp_stage=vp,
                **gpt_model_kwargs(spec, layout),
            )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if model.post_process:
            mask_vocab_padding(model, spec.vocab_size)
        for block in blocks():
            block.model(spec, model)
        chunks.append(model)
    return chunks


def mask_vocab_padding(model: Any, vocab_size: int) -> None:
    """Give the padded vocabulary rows logit -inf on the rank that holds them.

    Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by · tp; the
    padding rows would otherwise take part in the softmax, so the loss would differ from the
    Hugging Face model's and — because the padding depends on tp — between layouts. With the
    mask the loss and its gradients equal the unpadded model's at every tp."""
    layer = model.output_layer
    per_rank = layer.output_size_per_partition
    first_pad = vocab_size - ps.get_tensor_model_parallel_rank() * per_rank  # local column index
    if first_pad >= per_rank:
        return
    first_pad = max(first_pad, 0)

    def hook(_module, _inputs, output):
        logits, bias = output
        mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        mask[first_pad:] = True
        return logits.masked_fill(mask, float("-inf")), bias

    layer.register_forward_hook(hook)


__all__ = ["build_native", "mask_vocab_padding"]
