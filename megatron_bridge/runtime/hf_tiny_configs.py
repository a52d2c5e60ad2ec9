"""The tiny-model rule's tables (runtime/hf_tiny.py): the sizes every architecture gets, the
optional features switched on wherever a config class has them, and the per-architecture
overrides the generic rule cannot guess (each with its reason). Plain data: no imports."""

from __future__ import annotations

from typing import Any

LAYERS = 4
HIDDEN = 96
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 40
VOCAB = 256
EXPERTS = 4
TOP_K = 2
MAX_PARAMS = 5_000_000
WINDOW = 8  # sliding window, attention chunk, indexer top-k, in tokens: run sequences of 16 or more

# The generic rule, sizes: a field the config class has gets this value.
SIZES: dict[str, Any] = {
    # widths
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": 176,
    "intermediate_size_mlp": 176,
    "ffn_hidden_size": 176,
    "dense_intermediate_size": 176,
    "prefix_dense_intermediate_size": 176,
    # depth
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    # mixture of experts
    "num_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "top_k_experts": TOP_K,
    "n_group": 2,
    "topk_group": 1,
    "moe_intermediate_size": 56,
    "expert_ffn_hidden_size": 56,
    "shared_expert_intermediate_size": 56,
    "shared_experts_intermediate_size": 56,
    "shared_intermediate_size": 56,
    "moe_shared_expert_intermediate_size": 56,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "moe_layer_start_index": 1,
    "mlp_only_layers": [0],
    "zero_expert_num": 2,
    # multi-head latent attention
    "q_lora_rank": 72,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": HEAD_DIM,
    "o_lora_rank": 72,
    "o_groups": 2,
    # sparse-attention indexers
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 8,
    "index_block_size": 4,
    "index_topk_blocks": 2,
    # windows and patterns
    "sliding_window": WINDOW,
    "sliding_window_size": WINDOW,
    "attention_chunk_size": WINDOW,
    "max_window_layers": 1,
    "sliding_window_pattern": 2,
    "global_attn_every_n_layers": 2,
    "no_rope_layer_interval": 2,
    "layer_group_size": 2,
    "block_size": WINDOW,
    "chunk_size": WINDOW,
    # linear attention / state-space mixers
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "mamba_d_state": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 24,
    "mamba_chunk_size": WINDOW,
    "ssm_state_size": 16,
    "mamba_num_heads": 8,
    "mamba_head_dim": 24,
    "n_groups": 2,
    # other low-rank and auxiliary widths
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
    "laurel_rank": 8,
    "gated_norm_rank": 8,
    "hc_lowrank": 16,
    "swa_num_attention_heads": HEADS,
    "swa_num_key_value_heads": KV_HEADS,
    "swa_head_dim": HEAD_DIM,
    "num_kv_shared_layers": 2,
    "n_shared_experts": 1,
    "keep_window_size": WINDOW,
    "rel_extent": 16,
    "unpadded_vocab_size": VOCAB,
    "log_scaling_n_floor": WINDOW,
    "n_layers_per_attn_res_block": 2,
    "rotary_dim": 16,
    "num_shared_experts": 1,
}

# The generic rule, features: optional parts several classes share, switched on where the class has the field
# (biases and scales that a parallel implementation can drop or apply twice).
FEATURES: dict[str, Any] = {
    "attention_bias": True,
    "mlp_bias": True,
    "use_bias": True,
    "qkv_bias": True,
    "attention_out_bias": True,
    "lm_head_bias": True,
    "mamba_proj_bias": True,
    "conv_bias": True,
    "use_qk_norm": True,
    "qk_layernorm": True,
    "clip_qkv": 0.5,
    "embedding_multiplier": 4.0,
    "logits_scaling": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.25,
    "use_mamba_kernels": False,
}

_HYBRID = ["linear_attention", "full_attention"] * (LAYERS // 2)
# Gemma 4's KV sharing: with 2 shared layers of 4 (the alternating default), layers 2-3 read layers
# 0-1, so every pp2 split cuts a pair (refused by name); one shared layer reading the layer before
# it keeps the pair on one stage at pp2, with both layer kinds present
_GEMMA4_KV = "one KV-shared layer next to the layer it reads, so pp2 keeps the pair on one stage"
# the class default leaves the final logit softcap off (None); Gemma 4's released configs set it
_GEMMA4_SOFTCAP = "the final logit softcap is off (None) by default, on as in a released config"
_GEMMA4_KV_FIELDS = {
    "num_kv_shared_layers": 1,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"],
}

# Per-architecture config tweaks the generic rule cannot guess: model_type -> (reason, fields). The fields
# win over the generic rule's; a dict value updates a sub-config's fields. Keys the config class does not
# declare are ones its __post_init__ reads from its keyword arguments.
OVERRIDES: dict[str, tuple[str, dict[str, Any]]] = {
    "afmoe": ("muP scaling is off by default", {"mup_enabled": True}),
    "cohere_compass_text": (
        "rope parameters are per layer kind and the default has none; full-attention layers are NoPE",
        {
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": None,
            }
        },
    ),
    "deepseek_v2": (
        "the released V2 routes within a limited set of expert groups; the default is plain greedy",
        {"topk_method": "group_limited_greedy"},
    ),
    "deepseek_v4": (
        "the default heavily-compressed rate (128) leaves no compressed token in a short sequence",
        {"compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}},
    ),
    "doge": ("the cross-domain MoE (product-key experts: a square count) is off by default", {"is_moe": True}),
    "dots3_note_text": (
        "sliding layers take their MLA sizes from swa_* keywords (defaults are full size)",
        {
            "swa_num_attention_heads": HEADS,
            "swa_num_key_value_heads": HEADS,
            "swa_q_lora_rank": 72,
            "swa_kv_lora_rank": 32,
            "swa_head_dim": 64,
            "swa_qk_nope_head_dim": 48,
            "swa_v_head_dim": HEAD_DIM,
            "head_dim": 64,
        },
    ),
    "glm_moe_dsa": (
        "every layer runs its own indexer by default; 'shared' layers reuse the previous layer's top-k",
        {"indexer_types": ["full", "shared"] * (LAYERS // 2)},
    ),
    "falcon": (
        "biases are off by default (one `bias` flag); the default is multi-query, parallel attention + MLP",
        {"bias": True},
    ),
    "gemma3n_text": (
        "the default makes the first 10 layers sparse only in models deeper than 10 layers",
        {"activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0]},
    ),
    "gemma4_text": (
        "the MoE block and K=V global attention are off by default; global layers keep a wider head (512 by default); "
        + _GEMMA4_KV
        + "; "
        + _GEMMA4_SOFTCAP,
        {
            "enable_moe_block": True,
            "attention_k_eq_v": True,
            "use_double_wide_mlp": True,
            "global_head_dim": 56,
            "num_global_key_value_heads": 4,
            **_GEMMA4_KV_FIELDS,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma4_unified_text": (
        "K=V global attention is off by default; global layers keep a wider head (512 by default); "
        + _GEMMA4_KV
        + "; "
        + _GEMMA4_SOFTCAP,
        {
            "attention_k_eq_v": True,
            "use_double_wide_mlp": True,
            "global_head_dim": 56,
            "num_global_key_value_heads": 4,
            **_GEMMA4_KV_FIELDS,
            "final_logit_softcapping": 30.0,
        },
    ),
    "granitemoehybrid": (
        "the default stack is all Mamba; real checkpoints interleave attention",
        {"layer_types": _HYBRID},
    ),
    "granite_swa": (
        "every layer has the same rope theta by default; one per layer, 0 for NoPE, takes a rotary module each",
        {"layer_rope_theta": [0.0, 10000.0, 500000.0, 10000.0]},
    ),
    "granitemoe_swa": (
        "every layer has the same rope theta by default; one per layer, 0 for NoPE, takes a rotary module each",
        {"layer_rope_theta": [0.0, 10000.0, 500000.0, 10000.0]},
    ),
    "helium": ("o_proj is hidden×hidden, so heads×head_dim must equal the hidden size", {"head_dim": HIDDEN // HEADS}),
    "jamba": (
        "attention and expert layers come from period/offset fields (default period 8 misses a 4-layer stack)",
        {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 0},
    ),
    "laguna": (
        "the class takes a head count per layer; the default repeats one",
        {"num_attention_heads_per_layer": [4, 8, 4, 8]},
    ),
    "lfm2_moe": (
        "layer_types has no default; the model interleaves short convolutions and attention",
        {"layer_types": ["conv", "full_attention"] * (LAYERS // 2)},
    ),
    "llama4": (
        "composite config: the causal LM runs its text_config; same tweaks as llama4_text",
        {"text_config": {"interleave_moe_layer_step": 2, "floor_scale": 4}},
    ),
    "llama4_text": (
        "MoE on every other layer as released; a floor_scale of 8192 keeps attention temperature tuning off in short sequences",
        {"interleave_moe_layer_step": 2, "floor_scale": 4},
    ),
    "minimax_m3_vl_text": (
        "the lightning-indexer sparse attention layers are off by default",
        {"layer_types": ["minimax_m3_sparse", "full_attention"] * (LAYERS // 2)},
    ),
    "phi4_multimodal": (
        "the causal LM holds the audio and vision encoders, whose sizes are their own fields",
        {
            "vision_config": {"image_size": 28, "crop_size": 28, "patch_size": 14},
            "audio_config": {
                "num_blocks": 1,
                "ext_pw_out_channel": 96,
                "depthwise_separable_out_channel": 96,
                "nemo_conv_channels": 32,
            },
        },
    ),
    "qwen4_exp_text": (
        "the QSA indexer and per-layer n-gram embeddings (which need an eos id) are off by default; the n-gram table has "
        "20M rows, saved in two pieces as a released checkpoint saves it in many",
        {
            "indexer_n_heads": 4,
            "indexer_kv_heads": 1,
            "indexer_head_dim": HEAD_DIM,
            "indexer_budget": 8,
            "indexer_compress_ratio": 4,
            "ple_layer_ids": [1],
            "ple_embed_dim": 48,
            "ngram_size": 2,
            "heads_per_ngram": 2,
            "ngram_vocab_size_base": 97,
            "make_ngram_vocab_size_divisible_by": 8,
            "split_ngram_parts": 2,
            "eos_token_id": 2,
        },
    ),
}

# Further tiny models of one model type where config flags switch its layout (the matrix runs each
# as an architecture of its own): name -> (model type, reason, fields over the model type's own).
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "falcon_new_decoder": (
        "falcon",
        "Falcon-40B/180B: new_decoder_architecture, query_key_value fused per K/V group, two layer norms",
        {"new_decoder_architecture": True, "num_kv_heads": KV_HEADS},
    ),
    "falcon_rw": (
        "falcon",
        "Falcon-RW without ALiBi: multi-head (query_key_value fused per head), attention then MLP in sequence",
        {"multi_query": False, "parallel_attn": False},
    ),
}
