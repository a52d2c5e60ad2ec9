"""SmolLM3 (`SmolLM3ForCausalLM`): the Llama table with NoPE layers and tied embeddings.

`no_rope_layers[i] == 1` means layer i *uses* rope (transformers' SmolLM3 attention:
`use_rope = config.no_rope_layers[layer_idx]`); absent, transformers makes every
`no_rope_layer_interval`-th layer NoPE, so a written config always lists them
(`hf_names`). Optional sliding windows follow `layer_types` (features/attention.py).
"""

from collections.abc import Mapping as TMapping
from typing import Any

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS
from megatron_bridge.bridge.registry import FamilyBridge, register


@register
class SmolLM3(FamilyBridge):
    name = "smollm3"
    tiny = (
        "SmolLM3Config",
        dict(
            no_rope_layers=[1, 0, 1, 0],
            use_sliding_window=True,
            sliding_window=8,  # transformers puts it on the NoPE layers
            tie_word_embeddings=True,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("smollm3",)
    architectures = ("SmolLM3ForCausalLM",)
    table = EMBEDDINGS + ATTENTION + DENSE_MLP
    window_key = "layer_types"
    hf_names = {"nope_pattern": "no_rope_layers"}
    notes = "NoPE layers (no_rope_layers), tied embeddings, optional per-layer sliding windows"

    @classmethod
    def read_hf(cls, hf: TMapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        if hf.get("no_rope_layers") is None:  # transformers' default: every interval-th layer is NoPE
            every, n = int(hf.get("no_rope_layer_interval") or 4), int(hf.get("num_hidden_layers") or 0)
            pattern = tuple(int((i + 1) % every == 0) for i in range(n))
            fields["nope_pattern"] = pattern if any(pattern) else ()
