"""Llama (2, 3, 3.1+ with llama3 rope scaling) and Mistral: the plain dense table."""

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS
from megatron_bridge.bridge.registry import FamilyBridge, register


@register
class Llama(FamilyBridge):
    name = "llama"
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "GQA/MQA, rope default|linear|llama3, tied or untied embeddings"


@register
class Mistral(FamilyBridge):
    name = "mistral"
    model_types = ("mistral",)
    architectures = ("MistralForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "as llama, plus sliding-window attention (all layers)"
