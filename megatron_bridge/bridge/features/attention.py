"""Core attention: which module computes softmax(QK^T)V, and each layer's sliding window.

* The module (built by runtime/blocks/attention.py): Transformer Engine's
  `TEDotProductAttention` on a CUDA host with TE when every layer asks only for what it
  computes (causal, one window for all layers); otherwise our `ContextParallelAttention`
  (plain PyTorch, any cp, per-layer options passed as ModuleSpec params). The choice is
  printed once when a GPU run falls back to ours.
* Sliding windows: `sliding_window` (HF semantics: a query attends to keys with q - k < W)
  and `window_pattern` (1 = sliding layer, 0 = full layer; () = every layer alike). HF
  spells this three ways — `sliding_window` alone (Mistral), `use_sliding_window` plus
  per-layer `layer_types` (Qwen, Gemma, GPT-OSS, Ministral) — and all three are read here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature
from megatron_bridge.bridge.registry import weight_family


def needs_own_attention(spec: Any) -> list[str]:
    """What this spec asks of core attention that TE's module does not compute (empty: TE
    is fine). Features that add per-layer attention options add their reasons here."""
    why = []
    if spec.window_pattern and not all(spec.window_pattern):
        why.append("per-layer sliding windows")
    if spec.attn_logit_softcapping:
        why.append("attention logit soft-capping")
    if spec.attention_sinks:
        why.append("attention sinks")
    return why


def layer_window(spec: Any, index: int) -> int | None:
    """The sliding window of global layer `index` (None: full attention)."""
    if not spec.sliding_window:
        return None
    if spec.window_pattern and not spec.window_pattern[index]:
        return None
    return int(spec.sliding_window)


@register_feature
class CoreAttention(Feature):
    name = "core-attention"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        window = hf.get("sliding_window")
        if hf.get("use_sliding_window") is False:
            window = None
        fields["sliding_window"], fields["window_pattern"] = None, ()
        types = hf.get("layer_types")
        pattern: tuple[int, ...] = ()
        if types:
            unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
            if unknown:
                problems.append(f"layer_types {unknown} are not supported (full_attention, sliding_attention are)")
                return
            pattern = tuple(int(t == "sliding_attention") for t in types)
            if not any(pattern):
                return
        if window is None or int(window) <= 0:
            if pattern and any(pattern):
                problems.append("layer_types name sliding_attention layers but sliding_window is not set")
            return
        fields["sliding_window"] = int(window)
        fields["window_pattern"] = () if all(pattern) else pattern

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        n = spec.num_layers
        pattern = spec.window_pattern or ((1,) * n if spec.sliding_window else (0,) * n)
        if weight_family(spec.family).window_key == "layer_types":
            kinds = ["sliding_attention" if p else "full_attention" for p in pattern]
            cfg.update(
                use_sliding_window=bool(spec.sliding_window), layer_types=kinds, sliding_window=spec.sliding_window
            )
            if spec.sliding_window and not spec.window_pattern:
                cfg["max_window_layers"] = 0
        else:
            cfg["sliding_window"] = spec.sliding_window


__all__ = ["CoreAttention", "layer_window", "needs_own_attention"]
