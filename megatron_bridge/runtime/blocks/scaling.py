"""Scalings and soft-caps around the decoder (the description: bridge/features/scaling.py).

megatron's GPTModel has none of the model-level ones, so they are forward hooks on the built
chunk: the embedding output is multiplied on pre_process chunks — by a tensor of the hidden
dtype, as transformers' Gemma does (`embed_scale.to(dtype)`: in bf16 sqrt(3072) becomes
55.5) — and the output layer's logits are scaled and capped on post_process chunks. That
hook runs *before* `native.build.mask_vocab_padding`'s (prepended), so padded vocabulary rows are
still -inf after capping. Both are elementwise, so TP shards, SP and CP need nothing more.

The softmax scale is TransformerConfig.softmax_scale (every core attention takes it). The
attention soft-cap goes to the core attention as a ModuleSpec param; only the bridge's
`ContextParallelAttention` computes it (`needs_own_attention` says so on GPUs with TE).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_bridge.runtime.blocks.base import Block, register_block


def _add_params(holder: Any, attr: str, **params: Any) -> None:
    """Add constructor params to the submodule spec `holder.attr` (a class or a ModuleSpec)."""
    cur = getattr(holder, attr)
    if isinstance(cur, ModuleSpec):
        cur.params = {**(cur.params or {}), **params}
    else:
        setattr(holder, attr, ModuleSpec(module=cur, params=params))


def scale_embedding(chunk: Any, multiplier: float) -> None:
    def hook(_module, _inputs, out):
        return out * torch.tensor(multiplier, dtype=out.dtype, device=out.device)

    chunk.embedding.register_forward_hook(hook)


def scale_and_cap_logits(chunk: Any, divide_by: float, cap: float | None) -> None:
    def hook(_module, _inputs, output):
        logits, bias = output
        if divide_by != 1.0:
            logits = logits / divide_by
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits, bias

    chunk.output_layer.register_forward_hook(hook, prepend=True)  # before the vocab-padding mask


@register_block
class ScalingBlock(Block):
    name = "scaling"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        if spec.softmax_scale is not None:
            kw["softmax_scale"] = float(spec.softmax_scale)

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        if spec.attn_logit_softcapping:
            _add_params(
                layer_spec.submodules.self_attention.submodules,
                "core_attention",
                softcap=float(spec.attn_logit_softcapping),
            )

    @classmethod
    def model(cls, spec: Any, chunk: Any) -> None:
        if chunk.pre_process and spec.embedding_multiplier != 1.0:
            scale_embedding(chunk, float(spec.embedding_multiplier))
        if chunk.post_process and (spec.logits_scaling != 1.0 or spec.final_logit_softcapping):
            scale_and_cap_logits(chunk, float(spec.logits_scaling), spec.final_logit_softcapping)


__all__ = ["ScalingBlock", "scale_and_cap_logits", "scale_embedding"]
