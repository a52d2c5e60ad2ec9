"""Tiny but complete HF models of every supported family: their configs.

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


__all__ = ["TINY", "COMMON"]
