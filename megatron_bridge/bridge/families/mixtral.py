"""Mixtral: Mistral attention + top-k softmax MoE (w1 = gate, w3 = up, w2 = down)."""

from megatron_bridge.bridge.families.common import ATTENTION, EMBEDDINGS, experts
from megatron_bridge.bridge.registry import FamilyBridge, register


@register
class Mixtral(FamilyBridge):
    name = "mixtral"
    tiny = (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=True),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    table = (
        EMBEDDINGS + ATTENTION + experts("block_sparse_moe.experts", "w1", "w3", "w2", "block_sparse_moe.gate.weight")
    )
    hf_names = {"num_moe_experts": "num_local_experts", "moe_ffn_hidden_size": "intermediate_size"}
    notes = "MoE (softmax top-k, renormalised), sliding window"
