"""Core attention's build hooks (its description: bridge/features/attention.py).

The module: Transformer Engine's `TEDotProductAttention` on a CUDA host with TE when every
layer asks only for what it computes (`needs_own_attention` is empty), else our
`ContextParallelAttention` (runtime/cp_attention.py: plain PyTorch, any cp, per-layer
options as ModuleSpec params). The choice is printed once when a GPU run falls back to ours.
Per-layer sliding windows go to the core attention as a ModuleSpec param; one window for
every layer is TransformerConfig's `window_size`.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_bridge.bridge.features.attention import layer_window, needs_own_attention
from megatron_bridge.runtime.blocks.base import Block, register_block
from megatron_bridge.runtime.cp_attention import ContextParallelAttention

_SAID: set[str] = set()


def te_attention_class():
    """TE's DotProductAttention on a CUDA host with Transformer Engine, else None."""
    if not torch.cuda.is_available():
        return None
    # megatron-core imports without Transformer Engine (its TE classes then derive from a
    # MagicMock), so HAVE_TE, not ImportError, says whether TE is there.
    from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention  # optional: CUDA hosts only

    return TEDotProductAttention if HAVE_TE else None


def core_attention_module(spec: Any):
    """The core attention class for `spec` (see module docstring)."""
    te = te_attention_class()
    if te is None:
        return ContextParallelAttention
    why = needs_own_attention(spec)
    if not why:
        return te
    msg = f"core attention: the bridge's own module (Transformer Engine's cannot do {', '.join(why)})"
    if msg not in _SAID:
        _SAID.add(msg)
        print(msg, flush=True)
    return ContextParallelAttention


@register_block
class CoreAttentionBlock(Block):
    name = "core-attention"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        kw["window_size"] = (spec.sliding_window - 1, 0) if spec.sliding_window else None

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        module = core_attention_module(spec)
        sub = layer_spec.submodules.self_attention.submodules
        if spec.window_pattern:
            w = layer_window(spec, index)
            sub.core_attention = ModuleSpec(module=module, params={"window": (w - 1, 0) if w else None})
        else:
            sub.core_attention = module


__all__ = ["CoreAttentionBlock", "core_attention_module", "te_attention_class"]
