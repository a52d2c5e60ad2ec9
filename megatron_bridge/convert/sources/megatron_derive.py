"""An HF config.json from what a Megatron run recorded, for the models where that is unambiguous.

Without `model.hf_path` the run's own record (Megatron-LM's `args`, or the TransformerConfig
fields of Megatron-Bridge's / NeMo's YAML) says what the model is. Dense GPTs with RMSNorm,
SwiGLU, rotary embeddings and no linear biases have one HF architecture each here: Qwen3's
(per-head qk-norm), Qwen2's (bias on q, k and v only) or Llama's (neither; Megatron-LM's
`--use-rope-scaling` is Llama 3.1's scaling with its fixed constants). Anything else — MoE
routers (their scoring, pre/post-softmax, scaling and capacity are settings no HF architecture
carries in one way), MLA, LayerNorm or GELU models, sliding windows — is refused with
`model.hf_path` named, as is a record without these fields.

Megatron does not record the unpadded vocabulary unless `--vocab-size` was given; then the
stored embedding's rows are the vocabulary (`note` says so) and the export keeps the padding
rows. The tokenizer is never recorded: an export has no tokenizer files.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.convert.sources.megatron_model import RunRecord

_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _fields(record: RunRecord) -> Mapping[str, Any] | None:
    """The run's fields as Megatron-LM's args names them (a TransformerConfig's renamed)."""
    for kind, fields in record.records:
        if kind == "args":
            return fields
    for _, c in record.records:
        return {
            "num_layers": c.get("num_layers"),
            "hidden_size": c.get("hidden_size"),
            "num_attention_heads": c.get("num_attention_heads"),
            "num_query_groups": c.get("num_query_groups") or c.get("num_attention_heads"),
            "group_query_attention": True,
            "kv_channels": c.get("kv_channels"),
            "ffn_hidden_size": c.get("ffn_hidden_size"),
            "normalization": c.get("normalization", "LayerNorm"),
            "norm_epsilon": c.get("layernorm_epsilon", 1e-5),
            "swiglu": bool(c.get("gated_linear_unit")) and "silu" in str(c.get("activation_func", "silu")),
            "add_bias_linear": c.get("add_bias_linear", True),
            "add_qkv_bias": c.get("add_qkv_bias", False),
            "qk_layernorm": c.get("qk_layernorm", False),
            "num_experts": c.get("num_moe_experts"),
            "untie_embeddings_and_output_weights": not c.get("share_embeddings_and_output_weights", True),
            "rotary_base": c.get("rotary_base", 10000),
            "position_embedding_type": c.get("position_embedding_type", "rope"),
            "max_position_embeddings": c.get("seq_length"),
            "multi_latent_attention": c.get("multi_latent_attention", False),
            "vocab_size": c.get("vocab_size"),
            "bf16": c.get("bf16"),
        }
    return None


def derive_hf_config(record: RunRecord, rows: int) -> tuple[dict[str, Any] | None, str]:
    """(config.json, a note) for the model `record` describes, or (None, why not); `rows`: the
    stored embedding's rows (the vocabulary where none is recorded)."""
    a = _fields(record)
    if a is None:
        return None, "the checkpoint records no training arguments or model config"
    if any(a.get(k) is None for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size")):
        return None, "its record lacks the model's sizes"
    problems = []
    if a.get("num_experts"):
        problems.append("a MoE model (its router's settings map to no one HF architecture)")
    if a.get("multi_latent_attention"):
        problems.append("multi-latent attention")
    if a.get("normalization") != "RMSNorm":
        problems.append(f"normalization {a.get('normalization')}")
    if not a.get("swiglu"):
        problems.append("an MLP other than SwiGLU")
    if a.get("add_bias_linear"):
        problems.append("linear biases")
    if a.get("position_embedding_type", "rope") != "rope" or float(a.get("rotary_percent") or 1.0) != 1.0:
        problems.append("position embeddings other than full rotary")
    if a.get("window_size"):
        problems.append("sliding-window attention")
    if a.get("qk_layernorm") and a.get("add_qkv_bias"):
        problems.append("both qk-norm and qkv bias")
    if problems:
        return None, "it is " + ", ".join(problems)
    heads = int(a["num_attention_heads"])
    groups = int(a.get("num_query_groups") or heads) if a.get("group_query_attention") else heads
    head_dim = int(a.get("kv_channels") or int(a["hidden_size"]) // heads)
    arch, model_type = (
        ("Qwen3ForCausalLM", "qwen3")
        if a.get("qk_layernorm")
        else ("Qwen2ForCausalLM", "qwen2")
        if a.get("add_qkv_bias")
        else ("LlamaForCausalLM", "llama")
    )
    vocab = a.get("vocab_size")
    note = "" if vocab else f"the vocabulary is taken as the embedding's {rows} rows (the run recorded no --vocab-size)"
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(a.get("rotary_base") or 10000.0)}
    if a.get("use_rope_scaling"):
        if model_type != "llama":
            return None, "rope scaling on a model with qk-norm or qkv bias"
        rope.update(rope_type="llama3", factor=float(a.get("rope_scaling_factor") or 8.0), **_LLAMA3_ROPE)
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": int(a["hidden_size"]),
        "intermediate_size": int(a["ffn_hidden_size"]),
        "num_hidden_layers": int(a["num_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(a.get("max_position_embeddings") or a.get("seq_length") or 4096),
        "rms_norm_eps": float(a.get("norm_epsilon") or 1e-5),
        "rope_parameters": rope,
        "tie_word_embeddings": not a.get("untie_embeddings_and_output_weights", False),
        "vocab_size": int(vocab or rows),
        "dtype": "bfloat16" if a.get("bf16") else "float16" if a.get("fp16") else "float32",
        "initializer_range": float(a.get("init_method_std") or 0.02),
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config, note


__all__ = ["derive_hf_config"]
