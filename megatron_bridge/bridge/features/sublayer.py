"""Sublayer outputs before the residual add: post-attention / post-MLP norms (Gemma 2/3's
"sandwich", GLM-4, OLMo-2) and a residual multiplier (Granite).

megatron's TransformerLayer adds `self_attention(...)` / `mlp(...)` outputs to the residual
through its bias-dropout-add; it has no slot for a norm after the sublayer. So the sublayer
module itself is wrapped: `post_processed(SelfAttention)` runs the original forward, folds
its (row-parallel) bias into the output, applies the norm (`post_layernorm`, megatron name
`...self_attention.post_layernorm.weight` / `...mlp.post_layernorm.weight`) and the
multiplier, and returns (output, None). The output is the full hidden size on every TP
rank (sequence-split under SP), so the norm is per token and needs no communication.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature
from megatron_bridge.bridge.features.norms import norm_module

_WRAPPED: dict[tuple[type, Any], type] = {}
_METAS: dict[type, type] = {}


def _same_kind_meta(base: type) -> type:
    """The metaclass of a wrapped sublayer class: `base`'s own (type, ABCMeta, ...) except
    that the wrapped class compares equal to the class it wraps.

    TransformerLayer chooses the MLP's constructor arguments by `spec.module in (MoELayer,
    SequentialMLP, ...)` / `spec.module == MLP` (pg_collection for MoE, tp_group for MLP)
    and, for any other class, warns once per layer and passes neither. A wrapped MoELayer /
    MLP takes exactly the base's arguments, so only identity tells it from its base; hashing
    stays by identity (dict keys are unaffected)."""
    meta = type(base)
    if meta not in _METAS:

        def __eq__(cls, other: object) -> bool:
            return cls is other or other is getattr(cls, "_wrapped_base", None)

        _METAS[meta] = type(f"SameKind{meta.__name__}", (meta,), {"__eq__": __eq__, "__hash__": meta.__hash__})
    return _METAS[meta]


def post_processed(base: type, norm: Any) -> type:
    """`base` (SelfAttention, MLP, MoELayer, ...) with a post-norm and/or output multiplier.

    `norm` is the norm class or None; the multiplier comes in as a constructor param."""
    key = (base, norm)
    if key not in _WRAPPED:
        from megatron.core.transformer.mlp import MLP

        meta = _same_kind_meta(base)
        dense_mlp = base is MLP

        class PostProcessed(base, metaclass=meta):  # type: ignore[metaclass]
            _wrapped_base = base

            def __init__(self, *args: Any, output_multiplier: float = 1.0, **kwargs: Any) -> None:
                if dense_mlp:  # megatron warns (from this frame) when a dense MLP is not given its width
                    cfg = kwargs["config"] if "config" in kwargs else args[0]
                    kwargs.setdefault("ffn_hidden_size", cfg.ffn_hidden_size)
                super().__init__(*args, **kwargs)
                self.output_multiplier = output_multiplier
                if norm is not None:
                    cfg = self.config
                    self.post_layernorm = norm(config=cfg, hidden_size=cfg.hidden_size, eps=cfg.layernorm_epsilon)

            def forward(self, *args: Any, **kwargs: Any):
                out, bias = super().forward(*args, **kwargs)
                if bias is not None:
                    out = out + bias
                if norm is not None:
                    out = self.post_layernorm(out)
                if self.output_multiplier != 1.0:
                    out = out * self.output_multiplier
                return out, None

            def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None):
                """The base's, plus the post-norm as a tensor replicated over TP. megatron's MLP
                calls `sharded_state_dict` on each child, which a torch norm does not have, and
                SelfAttention's default passes its `tp_group` (None here: every rank would be
                replica 0) — `mbr convert` torch_dist output loaded by `train.init_from`."""
                from megatron.core import parallel_state
                from megatron.core.transformer.utils import sharded_state_dict_default

                post = self._modules.pop("post_layernorm", None)
                try:
                    out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
                finally:
                    if post is not None:
                        self._modules["post_layernorm"] = post  # back in its place: registered last
                if post is not None:
                    # the TP group named: without it every TP rank would claim the main replica
                    tp = parallel_state.get_tensor_model_parallel_group()
                    key = f"{prefix}post_layernorm."
                    out.update(sharded_state_dict_default(post, key, sharded_offsets, metadata, tp_group=tp))
                return out

        PostProcessed.__name__ = PostProcessed.__qualname__ = f"PostProcessed{base.__name__}"
        _WRAPPED[key] = PostProcessed
    return _WRAPPED[key]


def _wrap(module_spec: Any, norm: Any, multiplier: float) -> None:
    module_spec.module = post_processed(module_spec.module, norm)
    if multiplier != 1.0:
        module_spec.params = {**(module_spec.params or {}), "output_multiplier": multiplier}


@register_feature
class SublayerOutput(Feature):
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


__all__ = ["SublayerOutput", "post_processed"]
