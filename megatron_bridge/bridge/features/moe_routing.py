"""DeepSeek-style MoE routing (DeepSeek-V2/V3, Kimi-K2, Moonlight): the router transformers'
DeepseekV2/V3TopkRouter computes, as a megatron `TopKRouter` subclass (built by
runtime/blocks/moe_routing.py; read and written here).

What the config says (DeepSeek names) and the spec fields it sets:
  n_routed_experts, num_experts_per_tok, moe_intermediate_size  -> experts, top-k, expert size
  n_shared_experts · moe_intermediate_size                       -> one ungated shared expert
  first_k_dense_replace                                          -> moe_layer_pattern (dense
                                                                    layers use intermediate_size)
  routed_scaling_factor                                          -> moe_router_topk_scaling_factor
  n_group / topk_group                                           -> moe_router_num_groups / group_topk
  norm_topk_prob                                                 -> not moe_router_pre_softmax
  e_score_correction_bias (V3)                                   -> moe_router_expert_bias

Why our own router: megatron's sigmoid routing always renormalises the top-k weights, its
group score is the sum of the top (topk/group_topk) scores (V3 uses the top 2, V2 the max)
and its expert bias is a CUDA-only buffer updated by the training loop. Here the group score
follows the score function as in transformers (sigmoid: sum of the top 2 biased scores, V3;
softmax: the max, V2 `group_limited_greedy`), and the correction bias is a float32
Parameter with requires_grad=False: loaded and exported bit-exactly like any weight, never
given a gradient or touched by the optimizer, and not updated by megatron's bias update
(which runs only with moe_router_enable_expert_bias, left off).
Refused (transformers does not implement them): moe_layer_freq != 1, V2 topk_method other
than greedy / group_limited_greedy, V2 with norm_topk_prob=true (transformers ignores it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def uses_hf_router(spec: Any) -> bool:
    """Whether the spec needs this router (megatron's plain softmax top-k serves the rest)."""
    return bool(
        spec.is_moe
        and (
            spec.moe_router_score_function != "softmax"
            or spec.moe_router_expert_bias
            or spec.moe_router_num_groups
            or spec.moe_router_topk_scaling_factor
        )
    )


@register_feature
class DeepSeekRouting(Feature):
    name = "moe-routing"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        if not hf.get("n_routed_experts"):
            return
        n_layers = int(hf["num_hidden_layers"])
        moe_size = int(hf["moe_intermediate_size"])
        shared = int(hf.get("n_shared_experts") or 0)
        first_dense = int(hf.get("first_k_dense_replace") or 0)
        if int(hf.get("moe_layer_freq") or 1) != 1:
            problems.append("moe_layer_freq != 1 is not supported (transformers' DeepSeek models ignore it)")
        pattern = tuple(int(i >= first_dense) for i in range(n_layers))
        sigmoid = fields.get("moe_router_score_function") == "sigmoid"
        groups = hf.get("n_group")
        if not sigmoid:  # DeepSeek-V2: softmax, never renormalised by transformers
            method = hf.get("topk_method") or "greedy"
            if method not in V2_TOPK_METHODS:
                problems.append(f"topk_method={method!r} is not supported (transformers implements {V2_TOPK_METHODS})")
            if hf.get("norm_topk_prob"):
                problems.append("norm_topk_prob=true with softmax routing: transformers' DeepseekV2 ignores it")
            if method != "group_limited_greedy":
                groups = None
        scaling = float(hf.get("routed_scaling_factor") or 1.0)
        fields.update(
            num_moe_experts=int(hf["n_routed_experts"]),
            moe_router_topk=int(hf["num_experts_per_tok"]),
            moe_ffn_hidden_size=moe_size,
            moe_shared_expert_intermediate_size=shared * moe_size or None,
            moe_shared_expert_gate=False,
            moe_router_pre_softmax=not (sigmoid and bool(hf.get("norm_topk_prob"))),
            moe_layer_pattern=() if all(pattern) else pattern,
            moe_router_num_groups=int(groups) if groups else None,
            moe_router_group_topk=int(hf["topk_group"]) if groups else None,
            moe_router_topk_scaling_factor=scaling if scaling != 1.0 else None,
        )
        if groups and int(hf["n_routed_experts"]) % int(groups):
            problems.append("n_routed_experts must be a multiple of n_group")

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        if "n_routed_experts" not in cfg:
            return
        first_dense = spec.moe_layer_pattern.index(1) if spec.moe_layer_pattern else 0
        for k in ("mlp_only_layers", "decoder_sparse_step", "shared_expert_intermediate_size"):
            cfg.pop(k, None)
        shared = spec.moe_shared_expert_intermediate_size or 0
        cfg.update(
            n_shared_experts=shared // spec.moe_ffn_hidden_size,
            first_k_dense_replace=first_dense,
            routed_scaling_factor=spec.moe_router_topk_scaling_factor or 1.0,
            n_group=spec.moe_router_num_groups,
            topk_group=spec.moe_router_group_topk,
            norm_topk_prob=spec.moe_router_score_function == "sigmoid" and not spec.moe_router_pre_softmax,
        )
        if spec.moe_router_score_function == "softmax":
            cfg["topk_method"] = "group_limited_greedy" if spec.moe_router_num_groups else "greedy"


__all__ = ["DeepSeekRouting", "V2_TOPK_METHODS", "uses_hf_router"]
