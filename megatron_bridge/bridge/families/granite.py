"""Granite (3.x dense): the Llama table plus four scalars — input embeddings times
`embedding_multiplier`, softmax scale `attention_multiplier` (not 1/sqrt(head_dim): HF's
default is 1.0), sublayer outputs times `residual_multiplier` before the residual add,
logits divided by `logits_scaling`. The config keys are the BridgeSpec fields' names
except attention_multiplier (-> softmax_scale)."""

from __future__ import annotations

from collections.abc import Mapping as TMapping
from typing import Any

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS
from megatron_bridge.bridge.registry import FamilyBridge, register

SCALARS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")


@register
class Granite(FamilyBridge):
    name = "granite"
    tiny = (
        "GraniteConfig",
        dict(
            embedding_multiplier=12.0,
            attention_multiplier=0.3,
            residual_multiplier=0.22,
            logits_scaling=4.0,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("granite",)
    architectures = ("GraniteForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "as llama, plus embedding/attention/residual multipliers and logits scaling"

    @classmethod
    def read_hf(cls, hf: TMapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        for key in SCALARS:
            fields[key] = float(hf.get(key, 1.0))
        fields["softmax_scale"] = float(hf.get("attention_multiplier", 1.0))

    @classmethod
    def write_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        for key in SCALARS:
            cfg[key] = getattr(spec, key)
        cfg["attention_multiplier"] = spec.softmax_scale if spec.softmax_scale is not None else spec.head_dim**-0.5
