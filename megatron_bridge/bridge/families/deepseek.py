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
    model_types = ("deepseek_v2",)
    architectures = ("DeepseekV2ForCausalLM",)
    table = EMBEDDINGS + MLA + MOE
    hf_names = NAMES
    notes = "MLA (with or without q_lora_rank), softmax MoE greedy|group_limited_greedy, shared experts"


@register
class DeepseekV3(FamilyBridge):
    name = "deepseek_v3"
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
