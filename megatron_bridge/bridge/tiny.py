"""Tiny but complete HF models of every supported family (and of the transformers backend's sample
architectures, `HF_TINY`): their configs.

Used by the tests and by `mbr verify --tiny FAMILY`: each config exercises what the family
is about (GQA, llama3 rope scaling, sliding window shorter than the test sequence, qkv
bias, qk-norm with head_dim != hidden/heads, tied embeddings, MoE with a dense layer and a
gated shared expert) while staying small enough for a 2-core CPU. The models themselves
(transformers config objects, randomised weights, saved directories) are runtime/tiny.py's.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.bridge.registry import families

COMMON: dict[str, Any] = dict(
    vocab_size=250,  # not a multiple of 8·tp: exercises vocab padding
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,  # pp2·vpp2 needs 4
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _tiny_configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """family -> (transformers config class, overrides of COMMON): each family class declares
    its tiny model (`FamilyBridge.tiny`) next to its table."""
    return {cls.name: cls.tiny for cls in families() if cls.tiny is not None}


TINY: dict[str, tuple[str, dict[str, Any]]] = _tiny_configs()

# The transformers backend's sample architectures (transformers' own modeling code, docs/bridge.md "The
# transformers backend"): config class + overrides of COMMON, each with what is distinctive about it on;
# sliding windows are shorter than the test sequences. All but qwen3_swa have no native family
# (`auto` runs them on hf); qwen3_swa (and any native family's TINY model) runs on hf with
# `model.backend=transformers`.
HF_TINY: dict[str, tuple[str, dict[str, Any]]] = {
    # per-head qk LayerNorm ([heads, head_dim], split by head), logit scale, parallel
    # attention+MLP block, tied embeddings, padding_idx 0
    "cohere": (
        "CohereConfig",
        dict(
            use_qk_norm=True,
            logit_scale=0.25,
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        ),
    ),
    # Qwen3 on the transformers backend: q/k norm replicated_with_grad_allreduce, explicit head_dim,
    # sliding layers from layer 2 (masks by global layer index)
    "qwen3_swa": ("Qwen3Config", dict(head_dim=16, use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    # fused per-head query_key_value, parallel residual, partial rotary, biases, LayerNorm
    "gpt_neox": (
        "GPTNeoXConfig",
        dict(use_parallel_residual=True, attention_bias=True, bos_token_id=None, eos_token_id=None),
    ),
    # sliding window, biases everywhere, LayerNorm with bias, GELU MLP, tied embeddings
    "starcoder2": ("Starcoder2Config", dict(sliding_window=8, use_bias=True, bos_token_id=None, eos_token_id=None)),
    # per-head-dim q/k LayerNorm outside the tp plan (gradient summed over TP), partial
    # rotary, biased LM head, parallel block
    "phi": ("PhiConfig", dict(qk_layernorm=True, bos_token_id=None, eos_token_id=None)),
    # colwise_gather_output q/k/v with a norm over the whole projection, rowwise_split_input
    # o_proj, per-layer-type rotary, sliding/full layers
    "olmo3": ("Olmo3Config", dict(sliding_window=8, pad_token_id=None, eos_token_id=None)),
    # q/k norm replicated_with_grad_allreduce, alternating sliding/full layers
    "exaone4": (
        "Exaone4Config",
        dict(sliding_window=8, sliding_window_pattern=2, bos_token_id=None, eos_token_id=None),
    ),
}


__all__ = ["TINY", "COMMON", "HF_TINY"]
