"""Qwen2 (qkv bias), Qwen3 (qk-norm), Qwen2-MoE (routed + gated shared expert) and Qwen3-MoE
(qk-norm + routed experts, dense layers from mlp_only_layers / decoder_sparse_step)."""

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS, QK_NORM, H, L, experts, swiglu
from megatron_bridge.bridge.mapping import REPLICATED
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.table import Mapping


@register
class Qwen2(FamilyBridge):
    name = "qwen2"
    tiny = ("Qwen2Config", dict(tie_word_embeddings=True))  # bridge/tiny.py: every feature of the family on
    model_types = ("qwen2",)
    architectures = ("Qwen2ForCausalLM",)
    implicit = {"add_qkv_bias": True}
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    window_key = "layer_types"
    notes = "qkv bias"


@register
class Qwen3(FamilyBridge):
    name = "qwen3"
    tiny = ("Qwen3Config", dict(head_dim=16))  # bridge/tiny.py: every feature of the family on
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    implicit = {"qk_layernorm": True}
    table = EMBEDDINGS + ATTENTION + QK_NORM + DENSE_MLP
    window_key = "layer_types"
    notes = "qk-norm (RMSNorm per head), explicit head_dim"


@register
class Qwen2Moe(FamilyBridge):
    name = "qwen2_moe"
    tiny = (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)
    implicit = {"add_qkv_bias": True, "moe_shared_expert_gate": True}
    hf_names = {
        "num_moe_experts": "num_experts",
        "moe_ffn_hidden_size": "moe_intermediate_size",
        "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
        "add_qkv_bias": "qkv_bias",
    }
    window_key = "layer_types"
    table = (
        EMBEDDINGS
        + ATTENTION
        + DENSE_MLP  # layers listed in mlp_only_layers / off decoder_sparse_step
        + experts("mlp.experts", "gate_proj", "up_proj", "down_proj", "mlp.gate.weight")
        + swiglu(f"{L}.mlp.shared_experts", f"{H}.mlp.shared_expert")
        + (Mapping(f"{L}.mlp.shared_experts.gate_weight", f"{H}.mlp.shared_expert_gate.weight", REPLICATED),)
    )
    notes = "MoE (softmax top-k) + sigmoid-gated shared expert, qkv bias, dense layers allowed"


@register
class Qwen3Moe(FamilyBridge):
    name = "qwen3_moe"
    tiny = (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            use_sliding_window=True,
            sliding_window=8,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    implicit = {"qk_layernorm": True}
    hf_names = {"num_moe_experts": "num_experts", "moe_ffn_hidden_size": "moe_intermediate_size"}
    # Qwen3-MoE has no layer_types: use_sliding_window turns the window on for every layer
    window_key = "layer_types"
    table = (
        EMBEDDINGS
        + ATTENTION
        + QK_NORM
        + DENSE_MLP  # layers listed in mlp_only_layers / off decoder_sparse_step
        + experts("mlp.experts", "gate_proj", "up_proj", "down_proj", "mlp.gate.weight")
    )
    notes = "qk-norm per head + MoE (softmax top-k, norm_topk_prob), dense layers allowed"
