"""Build the megatron-core GPTModel of a `BridgeSpec` for a `Layout` (this rank's part).

The layer specs are megatron's local specs edited per layer by the bridge's features
(`layer_specs.py`, `features/`): the core attention is Transformer Engine's where TE and
CUDA are present and compute the same thing, else `ContextParallelAttention`; the features
a family's config turns on (windows, norms, scalings, ...) replace or wrap modules. Weight
names are the local spec's on every machine, which is what the mapping tables speak.

`build_model` returns one GPTModel per virtual pipeline chunk (a list of one without VPP),
each with pre_process/post_process set for its stage; the features' `model` hooks finish it
(features/rope.py puts in rotary frequencies computed exactly as transformers does).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_bridge.bridge.features.base import features
from megatron_bridge.bridge.hf_config import BridgeSpec, gpt_model_kwargs, transformer_config
from megatron_bridge.bridge.layer_specs import decoder_block_spec
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.errors import UserError


def check_groups(layout: Layout) -> None:
    """The initialized megatron groups must be the layout's (built by parallel.groups)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise UserError(
            "megatron-core parallel groups are not initialized; call "
            "megatron_bridge.parallel.groups.initialize(dims) first"
        )
    have = dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    want = dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp, vpp=layout.vpp)
    if (want["vpp"] or 1) == 1 and (have["vpp"] or 1) == 1:
        want["vpp"] = have["vpp"] = None
    bad = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
    if bad:
        raise UserError(
            "the initialized process groups do not match the layout: "
            + ", ".join(f"{k}={h} (layout {w})" for k, (h, w) in bad.items())
        )


def build_model(spec: BridgeSpec, layout: Layout, **config_overrides: Any) -> list[Any]:
    """This rank's GPTModel chunks for `spec` under `layout` (groups must be initialized).

    `config_overrides` go to TransformerConfig (params_dtype, bf16, recompute_granularity,
    ...). Weights are megatron's random init; load real ones with `loader.load_hf_weights`.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    check_groups(layout)
    tconfig = transformer_config(spec, layout, **config_overrides)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    vpp = tconfig.virtual_pipeline_model_parallel_size
    chunks = []
    for vp in range(vpp) if vpp else [None]:
        model = GPTModel(
            config=tconfig,
            transformer_layer_spec=decoder_block_spec(spec, tconfig, vp, pp_rank),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp,
            **gpt_model_kwargs(spec, layout),
        )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if model.post_process:
            mask_vocab_padding(model, spec.vocab_size)
        for feat in features():
            feat.model(spec, model)
        chunks.append(model)
    return chunks


def mask_vocab_padding(model: Any, vocab_size: int) -> None:
    """Give the padded vocabulary rows logit -inf on the rank that holds them.

    Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by · tp; the
    padding rows would otherwise take part in the softmax, so the loss would differ from the
    Hugging Face model's and — because the padding depends on tp — between layouts. With the
    mask the loss and its gradients equal the unpadded model's at every tp."""
    from megatron.core import parallel_state as ps

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


def model_config(chunks: list[Any]):
    return chunks[0].config


__all__ = ["build_model", "check_groups", "model_config"]
