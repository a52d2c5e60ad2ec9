"""Sublayer outputs before the residual add: post-attention / post-MLP norms (Gemma 2/3's
"sandwich", GLM-4, OLMo-2) and a residual multiplier (Granite).

megatron's TransformerLayer adds `self_attention(...)` / `mlp(...)` outputs to the residual
through its bias-dropout-add; it has no slot for a norm after the sublayer. So the sublayer
module itself is wrapped: `post_processed(SelfAttention)` runs the original forward, folds
its (row-parallel) bias into the output, applies the norm (`post_layernorm`, megatron name
`...self_attention.post_layernorm.weight` / `...mlp.post_layernorm.weight`) and the
multiplier, and returns (output, None). The output is the full hidden size on every TP
rank (sequence-split under SP), so the norm is per token and needs no communication.

The wrapped class is `PostProcessed` (an ordinary mixin) over whichever sublayer class the
earlier blocks chose; `post_processed` composes the two once per (base, norm).
"""

from __future__ import annotations

import functools
from typing import Any

from megatron.core import parallel_state
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.utils import sharded_state_dict_default

from megatron_bridge.runtime.blocks.base import Block, register_block
from megatron_bridge.runtime.blocks.norms import norm_module


class SameKind:
    """Metaclass mixin: a wrapped sublayer class compares equal to the class it wraps.

    TransformerLayer chooses the MLP's constructor arguments by `spec.module in (MoELayer,
    SequentialMLP, ...)` / `spec.module == MLP` (pg_collection for MoE, tp_group for MLP)
    and, for any other class, warns once per layer and passes neither. A wrapped MoELayer /
    MLP takes exactly the base's arguments, so only identity tells it from its base; hashing
    stays by identity (dict keys are unaffected)."""

    def __eq__(cls, other: object) -> bool:
        return cls is other or other is getattr(cls, "_wrapped_base", None)

    __hash__ = type.__hash__


@functools.cache
def same_kind_meta(meta: type) -> type:
    """`meta` (the base's own metaclass: type, ABCMeta, ...) with `SameKind` equality."""
    return type(f"SameKind{meta.__name__}", (SameKind, meta), {})


class PostProcessed:
    """Mixin over a sublayer class (SelfAttention, MLP, MoELayer, ...): a post-norm
    (`_post_norm`, the norm class or None) and/or an output multiplier (constructor param)."""

    _wrapped_base: type
    _post_norm: Any = None

    def __init__(self, *args: Any, output_multiplier: float = 1.0, **kwargs: Any) -> None:
        if self._wrapped_base is MLP:  # megatron warns (from this frame) when a dense MLP is not given its width
            cfg = kwargs["config"] if "config" in kwargs else args[0]
            kwargs.setdefault("ffn_hidden_size", cfg.ffn_hidden_size)
        super().__init__(*args, **kwargs)
        self.output_multiplier = output_multiplier
        if self._post_norm is not None:
            cfg = self.config  # type: ignore[attr-defined]  # the sublayer's
            self.post_layernorm = self._post_norm(config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon)

    def forward(self, *args: Any, **kwargs: Any):
        out, bias = super().forward(*args, **kwargs)  # type: ignore[misc]  # the sublayer's
        if bias is not None:
            out = out + bias
        if self._post_norm is not None:
            out = self.post_layernorm(out)
        if self.output_multiplier != 1.0:
            out = out * self.output_multiplier
        return out, None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None):
        """The base's, plus the post-norm as a tensor replicated over TP. megatron's MLP
        calls `sharded_state_dict` on each child, which a torch norm does not have, and
        SelfAttention's default passes its `tp_group` (None here: every rank would be
        replica 0) — `mbr convert` torch_dist output loaded by `train.init_from`."""
        modules = self._modules  # type: ignore[attr-defined]  # a torch.nn.Module's
        post = modules.pop("post_layernorm", None)
        try:
            out = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        finally:
            if post is not None:
                modules["post_layernorm"] = post  # back in its place: registered last
        if post is not None:
            # the TP group named: without it every TP rank would claim the main replica
            tp = parallel_state.get_tensor_model_parallel_group()
            key = f"{prefix}post_layernorm."
            out.update(sharded_state_dict_default(post, key, sharded_offsets, metadata, tp_group=tp))
        return out


@functools.cache
def post_processed(base: type, norm: Any) -> type:
    """`base` (SelfAttention, MLP, MoELayer, ...) with a post-norm and/or output multiplier.

    `norm` is the norm class or None; the multiplier comes in as a constructor param."""
    name = f"PostProcessed{base.__name__}"
    cls = same_kind_meta(type(base))(
        name,
        (PostProcessed, base),
        {"_wrapped_base": base, "_post_norm": norm, "__module__": __name__, "__qualname__": name},
    )
    return cls


def _wrap(module_spec: Any, norm: Any, multiplier: float) -> None:
    module_spec.module = post_processed(module_spec.module, norm)
    if multiplier != 1.0:
        module_spec.params = {**(module_spec.params or {}), "output_multiplier": multiplier}


@register_block
class SublayerOutputBlock(Block):
    name = "sublayer-output"

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        sub = layer_spec.submodules
        mult = float(spec.residual_multiplier)
        attn_norm = norm_module(spec) if spec.post_attention_norm else None
        mlp_norm = norm_module(spec) if spec.post_mlp_norm else None
        if attn_norm is not None or mult != 1.0:
            _wrap(sub.self_attention, attn_norm, mult)
        if mlp_norm is not None or mult != 1.0:
            _wrap(sub.mlp, mlp_norm, mult)


__all__ = ["PostProcessed", "SublayerOutputBlock", "post_processed"]
