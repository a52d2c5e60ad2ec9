"""Linear biases beyond the qkv bias: o_proj (`attention_out_bias`), MLP/expert linears
(`mlp_bias`) and the router (`moe_router_bias`).

megatron-core has one switch, `add_bias_linear`, that biases every linear of a layer at
once: qkv, o_proj, dense and expert fc1/fc2 and (0.16) the MoE router. That is exactly an
HF model with all of them (GPT-OSS: attention_bias=true, biased experts and router), so the
bridge supports those and refuses partial sets (Llama's attention_bias without mlp_bias)
rather than build a model with biases HF lacks. megatron also refuses biased experts
under expert-TP > 1 (`moe-bias-etp` rule). Expert biases scale with the routing
probability exactly as HF's (W·x + b)·p; megatron adds that bias in place onto the
expert fc2 output, which autograd forbids when the TP reduce hands its input back as is
(etp 1), so biased experts get an fc2 whose output is a fresh tensor and whose bias is not
summed over TP a second time (runtime/blocks/bias.py, `expert_fc2_class`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature
from megatron_bridge.bridge.registry import weight_family


@register_feature
class LinearBiases(Feature):
    name = "linear-biases"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        if hf.get("attention_bias"):
            fields["add_qkv_bias"] = fields["attention_out_bias"] = True
        if hf.get("mlp_bias"):
            fields["mlp_bias"] = True
        out, mlp = fields.get("attention_out_bias", False), fields.get("mlp_bias", False)
        if (out or mlp or fields.get("moe_router_bias")) and not (out and mlp and fields.get("add_qkv_bias")):
            problems.append(
                f"attention_bias={out} (q/k/v + o_proj bias) with mlp_bias={mlp}: megatron's add_bias_linear "
                "biases every linear at once, so only models with all of them are supported"
            )

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        if spec.attention_out_bias:
            cfg["attention_bias"] = True
        if spec.mlp_bias and not weight_family(spec.family).implicit.get("mlp_bias"):
            cfg["mlp_bias"] = True


__all__ = ["LinearBiases"]
