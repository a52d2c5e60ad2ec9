"""Tiny but complete HF models of every supported family, built offline from configs.

Used by the tests and by `mbr verify --tiny FAMILY`: each config exercises what the family
is about (GQA, llama3 rope scaling, sliding window shorter than the test sequence, qkv
bias, qk-norm with head_dim != hidden/heads, tied embeddings, MoE with a dense layer and a
gated shared expert) while staying small enough for a 2-core CPU. Weights are randomised
(norms around 1, biases non-zero) so a swapped or dropped tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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

# family -> (transformers config class, overrides of COMMON)
TINY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
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
    ),
    "mistral": ("MistralConfig", dict(sliding_window=8, num_key_value_heads=1)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, tie_word_embeddings=True),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,  # != hidden / heads
            query_pre_attn_scalar=24,  # softmax scale != 1/sqrt(head_dim)
            sliding_window=8,  # alternating sliding / full layers (layer_types default)
            attn_logit_softcapping=0.5,  # small enough that tanh bends the scores
            final_logit_softcapping=0.5,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={  # sliding layers rotate at their own base
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            # attn_logit_softcapping stays off: transformers' SDPA path refuses it (Gemma 2 covers it)
            final_logit_softcapping=0.5,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        ),
    ),
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=12.0,
            attention_multiplier=0.3,
            residual_multiplier=0.22,
            logits_scaling=4.0,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[1],
            norm_topk_prob=True,
            use_sliding_window=True,
            sliding_window=8,
        ),
    ),
    "olmo2": ("Olmo2Config", dict(eos_token_id=None)),
    "olmoe": (
        "OlmoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            norm_topk_prob=False,
            clip_qkv=1.0,
            eos_token_id=None,
        ),
    ),
    "phi3": (
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
    ),
    "smollm3": (
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
    ),
    "ministral": (
        "MinistralConfig",
        dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, head_dim=16),
    ),
    "ministral3": (
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
    ),
    "gpt_oss": (  # every GPT-OSS feature
        "GptOssConfig",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters=dict(  # yarn with its attention factor; 16 < the 32-token test batch
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
            swiglu_limit=0.2,  # small: the random tiny activations must reach the clamp
        ),
    ),
    # MLA with q_lora_rank and yarn (mscale_all_dim: softmax scale and cos/sin factor), sigmoid routing + correction bias, 2 of 4 groups, scaling,
    # renormalised top-k, one shared expert, layer 0 dense.
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32,
                beta_slow=1,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),
    ),
    # DeepSeek-V2 (softmax, group_limited_greedy, scaling); V2-Lite (no q_lora_rank) is the
    # override q_lora_rank=None.
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            routed_scaling_factor=2.0,
            first_k_dense_replace=1,
        ),
    ),
    # GLM-4: sandwich norms, fused gate_up_proj, partial (0.5) interleaved rotary, q/k/v bias
    "glm4": (
        "Glm4Config",
        dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5, pad_token_id=0, eos_token_id=2),
    ),
    # GLM-4.5: partial rotary, qk-norm, q/k/v bias, sigmoid routing + correction bias, 2 of 4
    # groups, scaling, renormalised top-k, one shared expert, layer 0 dense, one MTP layer.
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            head_dim=16,
            attention_bias=True,
            use_qk_norm=True,
            partial_rotary_factor=0.5,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
        ),
    ),
}


def tiny_config(family: str, **overrides: Any):
    import transformers

    cls_name, extra = TINY[family]
    kw = {**COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kw)


def randomize_(model, seed: int = 0, scale: float = 0.08) -> None:
    """Deterministic non-trivial weights: norms scale by 1 ± 0.2, everything else N(0, scale).

    A zero-centred norm (Gemma: x·(1 + w)) stores w, so its weights are drawn around 0, not 1:
    weights of 1 would double the activations at every norm and turn fp32 reduction-order
    noise into differences as large as the tolerances."""
    import torch

    from megatron_bridge.bridge.hf_config import spec_from_hf

    centre = 0.0 if spec_from_hf(model.config.to_dict()).zero_centered_norm else 1.0
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(centre + 0.2 * noise)
            else:
                p.copy_(scale * noise)
        saved = model.state_dict()  # persistent buffers are weights too (DeepSeek-V3's e_score_correction_bias)
        for name, b in sorted(model.named_buffers()):
            if name in saved and b.is_floating_point():
                b.copy_(scale * torch.randn(b.shape, generator=g, dtype=torch.float32))


def make_tiny(family: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny randomised HF model of `family` to `out_dir`; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


__all__ = ["TINY", "COMMON", "tiny_config", "randomize_", "make_tiny"]
