"""`model.hf_path=DIR`: fill the model group from a Hugging Face `config.json`.

Only reads JSON (no transformers import): `mbr check` and `mbr plan` must stay fast. The
key table below is the one place that knows HF's common config names; the family (and the
settings HF leaves implicit, such as Qwen2's QKV bias) comes from the bridge's family registry.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_bridge.config.schema import ModelConfig
from megatron_bridge.errors import UserError

# ModelConfig field <- first HF key present.
HF_KEYS: dict[str, tuple] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "ffn_hidden_size": ("intermediate_size", "n_inner"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_query_groups": ("num_key_value_heads",),
    "kv_channels": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "tie_word_embeddings": ("tie_word_embeddings",),
    "norm_epsilon": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
    "rotary_base": ("rope_theta",),
    "num_moe_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    # Qwen2-MoE writes qkv_bias; Qwen2 has it implicitly (below). HF's attention_bias also
    # means an o_proj bias, which the bridge refuses, so it is not read as a qkv bias here.
    "add_qkv_bias": ("qkv_bias",),
}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise UserError(
            f"model.hf_path={path}: no config.json there. Point model.hf_path at a Hugging "
            "Face model directory (the one `save_pretrained` wrote)."
        )
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{cfg_file} is not valid JSON ({e}); re-export the model config.") from e


def hf_to_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Map an HF config dict to ModelConfig field values."""
    from megatron_bridge.bridge.registry import family_for

    family = family_for(hf)
    hf = dict(family.complete_hf(hf))  # keys the family's config class derives (as load_spec sees them)
    out: dict[str, Any] = {"family": family.name, "name": hf.get("_name_or_path") or hf.get("model_type", "")}
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    out.update({k: v for k, v in family.implicit.items() if k in model_fields})
    for field_name, keys in HF_KEYS.items():
        for k in keys:
            if hf.get(k) is not None:
                out[field_name] = hf[k]
                break
    rope = hf.get("rope_parameters") or {}
    if "rotary_base" not in out and rope.get("rope_theta") is not None:
        out["rotary_base"] = rope["rope_theta"]
    if out.get("num_moe_experts") is not None and "moe_ffn_hidden_size" not in out:
        out["moe_ffn_hidden_size"] = out.get("ffn_hidden_size")
    out["rotary_base"] = float(out.get("rotary_base", 10000.0))
    out["norm_epsilon"] = float(out.get("norm_epsilon", 1e-5))
    return out


def apply_hf_config(model_node: Any, path: str) -> None:
    """Overwrite the model node's fields with the values read from `path`/config.json."""
    for k, v in hf_to_model_fields(read_hf_config(path)).items():
        setattr(model_node, k, v)
