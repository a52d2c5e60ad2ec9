"""Ministral (`MinistralForCausalLM`, per-layer sliding windows from `layer_types`) and
Ministral-3 / Mistral-3 text (`Ministral3ForCausalLM`: yarn rope with its attention factor
and Llama-4 query scaling by position, features/rope.py). Both use the Mistral table.

Mistral-3 checkpoints are `Mistral3ForConditionalGeneration` (vision tower + projector +
`language_model`); transformers 5 has no text-only class for their weights, and the bridge
does not read the multimodal layout: convert the text model to `Ministral3ForCausalLM` first.
"""

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS
from megatron_bridge.bridge.registry import FamilyBridge, register


@register
class Ministral(FamilyBridge):
    name = "ministral"
    model_types = ("ministral",)
    architectures = ("MinistralForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    window_key = "layer_types"
    notes = "as mistral, with per-layer sliding/full attention (layer_types)"


@register
class Ministral3(FamilyBridge):
    name = "ministral3"
    model_types = ("ministral3",)
    architectures = ("Ministral3ForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "Mistral-3 text: yarn rope (attention factor), Llama-4 position scaling of queries"
