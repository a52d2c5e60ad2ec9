"""Llama (2, 3, 3.1+ with llama3 rope scaling) and Mistral: the plain dense table."""

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS
from megatron_bridge.bridge.registry import FamilyBridge, register


@register
class Llama(FamilyBridge):
    name = "llama"
    tiny = (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "GQA/MQA, rope default|linear|llama3, tied or untied embeddings"


@register
class Mistral(FamilyBridge):
    name = "mistral"
    tiny = (
        "MistralConfig",
        dict(sliding_window=8, num_key_value_heads=1),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("mistral",)
    architectures = ("MistralForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "as llama, plus sliding-window attention (all layers)"
