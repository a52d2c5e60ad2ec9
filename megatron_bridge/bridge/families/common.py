"""Row sets shared by the Llama-like families (same megatron names, same HF names).

A family table is a sum of these tuples plus its own rows. Parameterised builders take the
HF prefix so MoE families can reuse the MLP rows under their own module names.
"""

from __future__ import annotations

from megatron_bridge.bridge.mapping import GATE_UP, QKV, REPLICATED, ROW, VOCAB
from megatron_bridge.bridge.table import Mapping

L = "decoder.layers.{layer}"
H = "model.layers.{layer}"

EMBEDDINGS: tuple[Mapping, ...] = (
    Mapping("embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB),
    Mapping("decoder.final_layernorm.weight", "model.norm.weight", REPLICATED),
    Mapping("output_layer.weight", "lm_head.weight", VOCAB, when="!tie_word_embeddings"),
    # Tied: the last pipeline stage keeps its own copy of the embedding as output layer
    # (megatron syncs their grads); it is loaded from the embedding, never exported.
    Mapping("output_layer.weight", "model.embed_tokens.weight", VOCAB, when="tie_word_embeddings", export=False),
)

ATTENTION: tuple[Mapping, ...] = (
    Mapping(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight", REPLICATED),
    Mapping(
        f"{L}.self_attention.linear_qkv.weight",
        (f"{H}.self_attn.q_proj.weight", f"{H}.self_attn.k_proj.weight", f"{H}.self_attn.v_proj.weight"),
        QKV,
    ),
    Mapping(
        f"{L}.self_attention.linear_qkv.bias",
        (f"{H}.self_attn.q_proj.bias", f"{H}.self_attn.k_proj.bias", f"{H}.self_attn.v_proj.bias"),
        QKV,
        when="add_qkv_bias",
    ),
    Mapping(f"{L}.self_attention.linear_proj.weight", f"{H}.self_attn.o_proj.weight", ROW),
    Mapping(f"{L}.pre_mlp_layernorm.weight", f"{H}.post_attention_layernorm.weight", REPLICATED),
)

QK_NORM: tuple[Mapping, ...] = (
    Mapping(f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight", REPLICATED),
    Mapping(f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight", REPLICATED),
)


def swiglu(
    megatron: str, hf: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
) -> tuple[Mapping, ...]:
    """A SwiGLU MLP: fc1 = [gate; up] column-parallel, fc2 = down row-parallel."""
    return (
        Mapping(f"{megatron}.linear_fc1.weight", (f"{hf}.{gate}.weight", f"{hf}.{up}.weight"), GATE_UP),
        Mapping(f"{megatron}.linear_fc2.weight", f"{hf}.{down}.weight", ROW),
    )


DENSE_MLP = swiglu(f"{L}.mlp", f"{H}.mlp")


def experts(hf_experts: str, gate: str, up: str, down: str, router: str) -> tuple[Mapping, ...]:
    """Routed experts (megatron SequentialMLP, one MLP per expert) plus the router."""
    return (
        Mapping(f"{L}.mlp.router.weight", f"{H}.{router}", REPLICATED),
        *swiglu(f"{L}.mlp.experts.local_experts.{{expert}}", f"{H}.{hf_experts}.{{expert}}", gate, up, down),
    )


__all__ = ["EMBEDDINGS", "ATTENTION", "QK_NORM", "DENSE_MLP", "swiglu", "experts", "L", "H"]
