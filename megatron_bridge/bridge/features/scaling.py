"""Scalings and soft-caps around the decoder: input embedding multiplier (Gemma's
sqrt(hidden), Granite's embedding_multiplier), softmax scale (Gemma's
query_pre_attn_scalar^-0.5, Granite's attention_multiplier), attention logit soft-capping
(Gemma 2), logits divided by `logits_scaling` (Granite) and final logit soft-capping.

The soft-caps are read here (HF key = BridgeSpec field); the multipliers and the softmax
scale come from the families' own keys. How each is applied: runtime/blocks/scaling.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature

SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")  # HF key = BridgeSpec field


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


__all__ = ["SOFTCAP_KEYS", "Scaling"]
