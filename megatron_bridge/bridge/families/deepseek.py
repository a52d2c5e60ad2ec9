"""DeepSeek-V2 (and V2-Lite) and DeepSeek-V3 (also Kimi-K2, Moonlight): Multi-head Latent
Attention (features/mla.py) + DeepSeek MoE routing (features/moe_routing.py).

V2 routes by softmax (greedy or group-limited, no renormalisation); V3 by sigmoid with the
e_score_correction_bias, top-2-sum group scores and optional renormalisation. Both scale
the routed weights by routed_scaling_factor, add ungated shared experts, and keep the first
`first_k_dense_replace` layers dense. Multi-token-prediction layers (V3's
num_nextn_predict_layers, stored as model.layers.{num_hidden_layers + i}) are skipped on
load with a note (loader.resolve_checkpoint) and not written on export.
"""

from megatron_bridge.bridge.families.common import DENSE_MLP, EMBEDDINGS, H, L, experts, swiglu
from megatron_bridge.bridge.mapping import COLUMN, REPLICATED, ROW
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.table import Mapping

A, HA = f"{L}.self_attention", f"{H}.self_attn"

MLA = (
    Mapping(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight", REPLICATED),
    Mapping(f"{A}.linear_q_proj.weight", f"{HA}.q_proj.weight", COLUMN, when="!q_lora_rank"),
    Mapping(f"{A}.linear_q_down_proj.weight", f"{HA}.q_a_proj.weight", COLUMN, when="q_lora_rank"),
    Mapping(f"{A}.q_layernorm.weight", f"{HA}.q_a_layernorm.weight", REPLICATED, when="q_lora_rank"),
    Mapping(f"{A}.linear_q_up_proj.weight", f"{HA}.q_b_proj.weight", COLUMN, when="q_lora_rank"),
    Mapping(f"{A}.linear_kv_down_proj.weight", f"{HA}.kv_a_proj_with_mqa.weight", REPLICATED),  # features/mla.py
    Mapping(f"{A}.kv_layernorm.weight", f"{HA}.kv_a_layernorm.weight", REPLICATED),
    Mapping(f"{A}.linear_kv_up_proj.weight", f"{HA}.kv_b_proj.weight", COLUMN),
    Mapping(f"{A}.linear_proj.weight", f"{HA}.o_proj.weight", ROW),
    Mapping(f"{L}.pre_mlp_layernorm.weight", f"{H}.post_attention_layernorm.weight", REPLICATED),
)

MOE = (
    DENSE_MLP  # the first first_k_dense_replace layers
    + experts("mlp.experts", "gate_proj", "up_proj", "down_proj", "mlp.gate.weight")
    + swiglu(f"{L}.mlp.shared_experts", f"{H}.mlp.shared_experts")
)

NAMES = {"num_moe_experts": "n_routed_experts", "moe_ffn_hidden_size": "moe_intermediate_size"}


@register
class DeepseekV2(FamilyBridge):
    name = "deepseek_v2"
    # DeepSeek-V2 (softmax, group_limited_greedy, scaling); V2-Lite (no q_lora_rank) is the
    # override q_lora_rank=None.
    tiny = (
        "DeepseekV2Config",
        dict(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.0,
            first_k_dense_replace=1,
        ),
    )
    model_types = ("deepseek_v2",)
    architectures = ("DeepseekV2ForCausalLM",)
    table = EMBEDDINGS + MLA + MOE
    hf_names = NAMES
    notes = "MLA (with or without q_lora_rank), softmax MoE greedy|group_limited_greedy, shared experts"


@register
class DeepseekV3(FamilyBridge):
    name = "deepseek_v3"
    # MLA with q_lora_rank and yarn (mscale_all_dim: softmax scale and cos/sin factor), sigmoid routing + correction bias, 2 of 4 groups, scaling,
    # renormalised top-k, one shared expert, layer 0 dense.
    tiny = (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),
    )
    model_types = ("deepseek_v3", "kimi_k2")
    architectures = ("DeepseekV3ForCausalLM",)
    implicit = {"moe_router_score_function": "sigmoid", "moe_router_expert_bias": True}
    table = (
        EMBEDDINGS
        + MLA
        + MOE
        + (
            Mapping(
                f"{L}.mlp.router.expert_bias",
                f"{H}.mlp.gate.e_score_correction_bias",
                REPLICATED,
                when="moe_router_expert_bias",
            ),
        )
    )
    hf_names = NAMES
    notes = "MLA, sigmoid MoE with correction bias, group top-k, scaling, shared experts; MTP layers skipped"
