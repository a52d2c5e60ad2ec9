"""Scalings and soft-caps around the decoder: input embedding multiplier (Gemma's
sqrt(hidden), Granite's embedding_multiplier), softmax scale (Gemma's
query_pre_attn_scalar^-0.5, Granite's attention_multiplier), attention logit soft-capping
(Gemma 2), logits divided by `logits_scaling` (Granite) and final logit soft-capping.

megatron's GPTModel has none of the model-level ones, so they are forward hooks on the built
chunk: the embedding output is multiplied on pre_process chunks — by a tensor of the hidden
dtype, as transformers' Gemma does (`embed_scale.to(dtype)`: in bf16 sqrt(3072) becomes
55.5) — and the output layer's logits are scaled and capped on post_process chunks. That
hook runs *before* `model.mask_vocab_padding`'s (prepended), so padded vocabulary rows are
still -inf after capping. Both are elementwise, so TP shards, SP and CP need nothing more.

The softmax scale is TransformerConfig.softmax_scale (every core attention takes it). The
attention soft-cap goes to the core attention as a ModuleSpec param; only the bridge's
`ContextParallelAttention` computes it (`needs_own_attention` says so on GPUs with TE).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature

SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")  # HF key = BridgeSpec field


def _add_params(holder: Any, attr: str, **params: Any) -> None:
    """Add constructor params to the submodule spec `holder.attr` (a class or a ModuleSpec)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    cur = getattr(holder, attr)
    if isinstance(cur, ModuleSpec):
        cur.params = {**(cur.params or {}), **params}
    else:
        setattr(holder, attr, ModuleSpec(module=cur, params=params))


def scale_embedding(chunk: Any, multiplier: float) -> None:
    import torch

    def hook(_module, _inputs, out):
        return out * torch.tensor(multiplier, dtype=out.dtype, device=out.device)

    chunk.embedding.register_forward_hook(hook)


def scale_and_cap_logits(chunk: Any, divide_by: float, cap: float | None) -> None:
    import torch

    def hook(_module, _inputs, output):
        logits, bias = output
        if divide_by != 1.0:
            logits = logits / divide_by
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits, bias

    chunk.output_layer.register_forward_hook(hook, prepend=True)  # before the vocab-padding mask


@register_feature
class Scaling(Feature):
    name = "scaling"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        for key in SOFTCAP_KEYS:
            value = hf.get(key)
            fields[key] = float(value) if value else None

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        for key in SOFTCAP_KEYS:
            if getattr(spec, key):
                cfg[key] = getattr(spec, key)

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


__all__ = ["Scaling", "scale_embedding", "scale_and_cap_logits"]
