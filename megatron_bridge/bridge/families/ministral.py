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
    tiny = (
        "MinistralConfig",
        dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, head_dim=16),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("ministral",)
    architectures = ("MinistralForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    window_key = "layer_types"
    notes = "as mistral, with per-layer sliding/full attention (layer_types)"


@register
class Ministral3(FamilyBridge):
    name = "ministral3"
    tiny = (
        "Ministral3Config",
        dict(
            head_dim=8,
            sliding_window=8,
            max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=8.0,
                original_max_position_embeddings=16,  # < 32: Llama-4 query scaling is active
                beta_fast=32.0,
                beta_slow=1.0,
                llama_4_scaling_beta=0.1,
            ),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("ministral3",)
    architectures = ("Ministral3ForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    notes = "Mistral-3 text: yarn rope (attention factor), Llama-4 position scaling of queries"
