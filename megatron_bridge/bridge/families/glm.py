"""GLM-4 (`Glm4ForCausalLM`, GLM-4-0414) and GLM-4.5 (`Glm4MoeForCausalLM`, also GLM-4.6/4.7).

GLM-4: sandwich norms — `post_self_attn_layernorm` / `post_mlp_layernorm` normalise the
attention / MLP outputs before the residual add (features/sublayer.py), while its
`post_attention_layernorm` is the norm *before* the MLP, megatron's pre_mlp_layernorm.
`gate_up_proj` stacks [gate; up] on disk (StackedGateUp); rotary is partial (0.5) over
interleaved pairs (2i, 2i+1) (features/rope.py).

GLM-4.5: Llama-style layers (no sandwich norms), partial rotary on halves (not interleaved),
optional per-head qk-norm (`use_qk_norm`) and DeepSeek-V3's MoE: sigmoid scores with
`e_score_correction_bias`, group top-k on the top-2 sum, renormalisation, routed_scaling_factor,
ungated shared experts and dense first layers (features/moe_routing.py, whose sigmoid rule is
transformers' Glm4MoeTopkRouter line for line). MTP layers (`num_nextn_predict_layers`, stored
as model.layers.{num_hidden_layers + i}) are skipped on load with a note (features/mtp.py).

Both: `attention_bias` biases q/k/v only — transformers builds o_proj without a bias — so it is
read as a qkv bias (`complete_hf`), not as features/bias.py's attention_bias (which includes
o_proj). Config keys absent from older config.json files take the config classes' defaults.
"""

from __future__ import annotations

from collections.abc import Mapping as TMapping
from typing import Any, ClassVar

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS, QK_NORM, H, L, experts, swiglu
from megatron_bridge.bridge.mapping import REPLICATED, ROW
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.stacked import STACKED_GATE_UP
from megatron_bridge.bridge.table import Mapping


class _Glm(FamilyBridge):
    defaults: ClassVar[TMapping[str, Any]] = {}  # the transformers config class's defaults

    @classmethod
    def complete_hf(cls, hf: TMapping[str, Any]) -> TMapping[str, Any]:
        out = {**cls.defaults, **hf}
        rope = {**dict(out.get("rope_parameters") or {}), **dict(out.get("rope_scaling") or {})}
        if "partial_rotary_factor" not in out and "partial_rotary_factor" not in rope:
            out["partial_rotary_factor"] = 0.5  # both config classes' default
        out["qkv_bias"] = bool(out.pop("attention_bias", False))  # q/k/v only: no o_proj bias
        return out


GLM4_LAYER = (
    Mapping(f"{L}.self_attention.post_layernorm.weight", f"{H}.post_self_attn_layernorm.weight", REPLICATED),
    Mapping(f"{L}.mlp.linear_fc1.weight", f"{H}.mlp.gate_up_proj.weight", STACKED_GATE_UP),
    Mapping(f"{L}.mlp.linear_fc2.weight", f"{H}.mlp.down_proj.weight", ROW),
    Mapping(f"{L}.mlp.post_layernorm.weight", f"{H}.post_mlp_layernorm.weight", REPLICATED),
)


@register
class Glm4(_Glm):
    name = "glm4"
    # GLM-4: sandwich norms, fused gate_up_proj, partial (0.5) interleaved rotary, q/k/v bias
    tiny = (
        "Glm4Config",
        dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2),
    )
    model_types = ("glm4",)
    architectures = ("Glm4ForCausalLM",)
    defaults = {"attention_bias": True, "head_dim": 128}
    implicit = {"rotary_interleaved": True, "post_attention_norm": True, "post_mlp_norm": True}
    hf_names = {"add_qkv_bias": "attention_bias"}
    table = EMBEDDINGS + ATTENTION + GLM4_LAYER  # ATTENTION: post_attention_layernorm -> pre_mlp_layernorm
    notes = "sandwich norms, fused gate_up_proj on disk, partial interleaved rotary, qkv bias"


@register
class Glm4Moe(_Glm):
    name = "glm4_moe"
    # GLM-4.5: partial rotary, qk-norm, q/k/v bias, sigmoid routing + correction bias, 2 of 4
    # groups, scaling, renormalised top-k, one shared expert, layer 0 dense, one MTP layer.
    tiny = (
        "Glm4MoeConfig",
        dict(
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
        ),
    )
    model_types = ("glm4_moe",)
    architectures = ("Glm4MoeForCausalLM",)
    defaults = {
        "attention_bias": False,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    }
    implicit = {"moe_router_score_function": "sigmoid", "moe_router_expert_bias": True}
    hf_names = {
        "num_moe_experts": "n_routed_experts",
        "moe_ffn_hidden_size": "moe_intermediate_size",
        "add_qkv_bias": "attention_bias",
    }
    table = (
        EMBEDDINGS
        + ATTENTION
        + tuple(Mapping(m.megatron, m.hf, m.transform, when="qk_layernorm") for m in QK_NORM)
        + DENSE_MLP  # the first first_k_dense_replace layers
        + experts("mlp.experts", "gate_proj", "up_proj", "down_proj", "mlp.gate.weight")
        + swiglu(f"{L}.mlp.shared_experts", f"{H}.mlp.shared_experts")
        + (Mapping(f"{L}.mlp.router.expert_bias", f"{H}.mlp.gate.e_score_correction_bias", REPLICATED),)
    )
    notes = "sigmoid MoE with correction bias, group top-k, scaling, shared experts, dense first layers, qk-norm, partial rotary; MTP layers skipped"

    @classmethod
    def read_hf(cls, hf: TMapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        fields["qk_layernorm"] = bool(hf.get("use_qk_norm"))

    @classmethod
    def write_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        cfg["use_qk_norm"] = spec.qk_layernorm
