"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama layout with fused projections on disk.

`qkv_proj` stacks [q; k; v] and `gate_up_proj` stacks [gate; up] in one tensor each; the
stacked transforms (stacked.py) cut them into megatron's per-group QKV and per-rank
[gate_r; up_r] fc1, reading only a rank's rows. Rotary is longrope (short/long factors by
sequence length, attention factor) with partial rotary on Phi-4-mini; features/rope.py does
both. Phi-3's residual/embedding dropouts have no megatron counterpart here: refused if > 0.
"""

from __future__ import annotations

from collections.abc import Mapping as TMapping
from typing import Any

from megatron_bridge.bridge.families.common import EMBEDDINGS, H, L
from megatron_bridge.bridge.mapping import REPLICATED, ROW
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.stacked import STACKED_GATE_UP, STACKED_QKV
from megatron_bridge.bridge.table import Mapping


@register
class Phi3(FamilyBridge):
    name = "phi3"
    tiny = (
        "Phi3Config",
        dict(
            sliding_window=8,
            original_max_position_embeddings=16,  # < the 32-token test batch: the long factors and
            rope_parameters=dict(  # the attention factor are in use
                rope_type="longrope",
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                short_factor=[1.0, 1.7],
                long_factor=[1.5, 4.0],
            ),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("phi3",)
    architectures = ("Phi3ForCausalLM",)
    table = EMBEDDINGS + (
        Mapping(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight", REPLICATED),
        Mapping(f"{L}.self_attention.linear_qkv.weight", f"{H}.self_attn.qkv_proj.weight", STACKED_QKV),
        Mapping(f"{L}.self_attention.linear_proj.weight", f"{H}.self_attn.o_proj.weight", ROW),
        Mapping(f"{L}.pre_mlp_layernorm.weight", f"{H}.post_attention_layernorm.weight", REPLICATED),
        Mapping(f"{L}.mlp.linear_fc1.weight", f"{H}.mlp.gate_up_proj.weight", STACKED_GATE_UP),
        Mapping(f"{L}.mlp.linear_fc2.weight", f"{H}.mlp.down_proj.weight", ROW),
    )
    notes = "fused qkv_proj / gate_up_proj on disk, longrope, partial rotary, sliding window"

    @classmethod
    def read_hf(cls, hf: TMapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        for key in ("resid_pdrop", "embd_pdrop"):
            if float(hf.get(key) or 0.0) > 0:
                problems.append(f"{key} > 0 (Phi-3 residual/embedding dropout) is not supported; set it to 0")
