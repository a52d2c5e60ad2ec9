"""qk-norm over the whole projection (OLMo-2, OLMoE) and OLMoE's q/k/v clamp: the description.

`qk_norm_type` ("head": megatron's own per-head q/k layernorm; "full": RMSNorm over the whole
q and k projections, OLMo-2 / OLMoE) comes from the family (`implicit`); `clip_qkv` is
OLMoE's config key (q and k clamped after their norms, v after its projection). The modules
that compute them: runtime/blocks/qk_norm.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature


@register_feature
class QKNorm(Feature):
    name = "qk-norm"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        """qk_norm_type comes from the family (`implicit`); clip_qkv is OLMoE's config key."""
        clip = hf.get("clip_qkv")
        fields["clip_qkv"] = float(clip) if clip is not None else None
        if clip is not None and float(clip) <= 0:
            problems.append(f"clip_qkv={clip} must be positive")

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        if spec.clip_qkv is not None:
            cfg["clip_qkv"] = spec.clip_qkv


__all__ = ["QKNorm"]
