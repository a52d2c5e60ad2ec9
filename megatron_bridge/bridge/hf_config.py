"""HF `config.json` ⇄ `BridgeSpec` (megatron-core's TransformerConfig from it: runtime/tconfig.py).

`BridgeSpec` is the architecture as the bridge understands it: every field either maps to a
megatron-core setting or to a weight-table condition. Reading an HF config refuses, with
every reason at once, the features the megatron local spec cannot reproduce (o_proj bias,
multimodal rope, ...): a silently dropped feature would give a model that loads fine and
computes something else. Rotary settings are read and written by features/rope.py.

The common HF key names come from `config/hf_model.py` (one place knows them); the extra
keys only the bridge needs (rope scaling, windows, router details) are read here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping as TMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_bridge.bridge.features.base import features
from megatron_bridge.bridge.mapping import Shapes
from megatron_bridge.bridge.registry import family_for
from megatron_bridge.config.hf_model import HF_KEYS, hf_to_model_fields, read_hf_config
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.dims import padded_vocab_size

# HF hidden_act -> BridgeSpec.activation (the GLU's gate activation); the first HF name is written back
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class BridgeSpec:
    family: str
    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int = 2048
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    rope_type: str = "default"
    rope_params: tuple[tuple[str, Any], ...] = ()  # factor, low/high_freq_factor, original_max_...
    tie_word_embeddings: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    sliding_window: int | None = None  # HF semantics: attend to keys with q - k < window
    window_pattern: tuple[int, ...] = ()  # per layer: 1 = sliding, 0 = full; () = all alike
    attention_dropout: float = 0.0
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False  # softmax over all experts, no top-k renormalisation
    moe_layer_pattern: tuple[int, ...] = ()  # 1 = MoE layer, 0 = dense; () = every layer alike
    make_vocab_size_divisible_by: int = 128
    initializer_range: float = 0.02
    # What every HF family here is (RMSNorm, SwiGLU, no linear biases, rotary); the `gpt`
    # family (megatron GPT, no HF weight table) sets the GPT-2/3 values.
    normalization: str = "RMSNorm"
    gated_linear_unit: bool = True  # SwiGLU (silu); false = GELU MLP
    add_bias_linear: bool = False
    position_embedding_type: str = "rope"

    # ---- building blocks beyond the local spec (bridge/features/); every default is "off".
    # Field names are the planner's and the rules' vocabulary too: keep one meaning each.
    # attention
    softmax_scale: float | None = (
        None  # None = 1/sqrt(head_dim); Gemma query_pre_attn_scalar^-0.5, Granite attention_multiplier
    )
    attn_logit_softcapping: float | None = None  # scores -> cap·tanh(scores/cap) (Gemma 2)
    attention_sinks: bool = False  # a learned per-head sink logit in the softmax (GPT-OSS `sinks`)
    qk_norm_type: str = (
        "head"  # with qk_layernorm: "head" = RMSNorm per head, "full" = over the whole q/k projection (OLMo-2, OLMoE)
    )
    clip_qkv: float | None = None  # q, k (after qk-norm) and v clamped to [-c, c] (OLMoE clip_qkv)
    attention_out_bias: bool = False  # o_proj bias without MLP biases (HF attention_bias=true also sets add_qkv_bias)
    # rotary position embedding
    rotary_percent: float = 1.0  # partial_rotary_factor: the first rotary_percent·head_dim dims rotate
    rotary_interleaved: bool = False  # pairs (2i, 2i+1) rotate (GLM) instead of (i, i + d/2)
    rope_local_base: float | None = None  # rope base of sliding-window layers (Gemma 3 rope_local_base_freq)
    nope_pattern: tuple[int, ...] = ()  # per layer: 1 = no rotary (NoPE) layer; () = rotary everywhere (SmolLM3)
    # norms
    zero_centered_norm: bool = False  # RMSNorm computes x·(1 + w) (Gemma); weights stored as w
    pre_norms: bool = True  # input/pre-MLP norms; False = OLMo-2 ordering (norms only on the sublayer outputs)
    post_attention_norm: bool = (
        False  # norm of the attention output before the residual add (Gemma 2/3 sandwich, GLM-4, OLMo-2)
    )
    post_mlp_norm: bool = False  # norm of the MLP output before the residual add
    # MLP
    activation: str = "silu"  # GLU activation: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma) | gelu
    mlp_bias: bool = False  # biases on the MLP (and expert) linears without attention biases
    glu_clamp: float | None = None  # GPT-OSS: gate clamped to (-inf, c], up to [-c, c]
    glu_alpha: float = 1.0  # GPT-OSS: gate·sigmoid(alpha·gate)
    glu_linear_offset: float = 0.0  # GPT-OSS: (up + offset)·act(gate)
    # MoE routing
    moe_router_score_function: str = "softmax"  # softmax | sigmoid (DeepSeek-V3, GLM-4.5)
    moe_router_expert_bias: bool = False  # e_score_correction_bias: added for top-k selection only
    moe_router_num_groups: int | None = None  # n_group: experts in groups, top `group_topk` groups first
    moe_router_group_topk: int | None = None  # topk_group
    moe_router_topk_scaling_factor: float | None = None  # routed_scaling_factor
    moe_router_bias: bool = False  # a learned router bias (GPT-OSS)
    # Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None = q_proj directly (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_head_dim: int = 128  # qk_nope_head_dim
    qk_pos_emb_head_dim: int = 64  # qk_rope_head_dim
    v_head_dim: int = 128
    mtp_num_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped on load, noted)
    # embeddings and head
    embedding_multiplier: float = 1.0  # input embeddings scaled (Gemma sqrt(hidden), Granite embedding_multiplier)
    residual_multiplier: float = 1.0  # sublayer outputs scaled before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    final_logit_softcapping: float | None = None  # logits -> cap·tanh(logits/cap) (Gemma 2)

    @property
    def is_moe(self) -> bool:
        return bool(self.num_moe_experts)

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def shapes(self, tp: int) -> Shapes:
        return Shapes(
            self.num_attention_heads, self.num_query_groups, self.head_dim, self.vocab_size, self.padded_vocab_size(tp)
        )

    def replace(self, **kw: Any) -> BridgeSpec:
        return dataclasses.replace(self, **kw)


# ----------------------------------------------------------------------------------------
# HF -> spec
# ----------------------------------------------------------------------------------------


def _moe_pattern(hf: TMapping[str, Any], n_layers: int) -> tuple[int, ...]:
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    pattern = tuple(0 if (i in dense or (i + 1) % step) else 1 for i in range(n_layers))
    return () if all(pattern) else pattern


def spec_from_hf(hf: TMapping[str, Any], *, make_vocab_size_divisible_by: int = 128) -> BridgeSpec:
    """Build (and validate) the spec of an HF config dict. Raises UserError listing every
    unsupported feature."""
    family = family_for(hf)
    hf = family.complete_hf(hf)
    base = hf_to_model_fields(dict(hf))
    problems: list[str] = []
    f: dict[str, Any] = {}
    f["family"] = family.name
    f["architecture"] = (hf.get("architectures") or family.architectures)[0]
    missing = [
        k
        for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
        if base.get(k) is None
    ]
    if missing:
        raise UserError(
            f"config.json lacks {', '.join(missing)} (HF names: {', '.join(HF_KEYS[k][0] for k in missing)})"
        )
    for k in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
        "norm_epsilon",
    ):
        if base.get(k) is not None:
            f[k] = base[k]
    heads = base["num_attention_heads"]
    f["num_query_groups"] = int(base.get("num_query_groups") or heads)
    f["head_dim"] = int(base.get("kv_channels") or base["hidden_size"] // heads)
    f["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    f["attention_dropout"] = float(hf.get("attention_dropout") or 0.0)
    f["initializer_range"] = float(hf.get("initializer_range") or 0.02)
    f["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    f.update(family.implicit)
    if "qkv_bias" in hf:
        f["add_qkv_bias"] = bool(hf["qkv_bias"])

    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act in HF_ACTIVATIONS:
        f["activation"] = HF_ACTIVATIONS[act]
    else:
        problems.append(f"hidden_act={act!r}: only SwiGLU (silu) and GeGLU (gelu_pytorch_tanh) MLPs are supported")
    family.read_hf(hf, f, problems)
    for feat in features():
        feat.read(hf, f, problems)

    if base.get("num_moe_experts") and "num_moe_experts" not in f:  # else a feature read the MoE keys
        f["num_moe_experts"] = int(base["num_moe_experts"])
        f["moe_router_topk"] = int(base.get("moe_router_topk", 2))
        f["moe_ffn_hidden_size"] = int(base.get("moe_ffn_hidden_size") or base["ffn_hidden_size"])
        shared = base.get("moe_shared_expert_intermediate_size")
        f["moe_shared_expert_intermediate_size"] = int(shared) if shared else None
        if not shared:
            f["moe_shared_expert_gate"] = False
        # HF families either renormalise the top-k softmax probabilities (Mixtral,
        # norm_topk_prob=true) or keep the full-softmax probabilities (Qwen2-MoE default).
        f["moe_router_pre_softmax"] = not bool(hf.get("norm_topk_prob", True))
        f["moe_layer_pattern"] = _moe_pattern(hf, f["num_layers"])
        if f["moe_router_topk"] == 1 and not f["moe_router_pre_softmax"]:
            problems.append("top-1 routing with renormalised probabilities (always 1.0) is not supported")
        if float(hf.get("router_jitter_noise") or 0.0) > 0:
            problems.append("router_jitter_noise > 0 (training-time router noise) is not supported; set it to 0")
    if problems:
        raise UserError(
            f"{f['architecture']} config cannot be bridged faithfully:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    return BridgeSpec(**f)


def load_spec(path: str | Path, *, make_vocab_size_divisible_by: int = 128) -> BridgeSpec:
    return spec_from_hf(read_hf_config(path), make_vocab_size_divisible_by=make_vocab_size_divisible_by)


# ModelConfig fields that are not architecture (or reach the spec resolved under another name).
NOT_SPEC_FIELDS = ("name", "hf_path", "kv_channels", "num_query_groups", "moe_ffn_hidden_size")


def spec_from_model_config(model_cfg: Any) -> BridgeSpec:
    """The spec of `cfg.model` (a ModelConfig): from its hf_path when set, else its fields.

    Every ModelConfig field that names architecture is a BridgeSpec field of the same name
    and is copied by name (a test holds the two field lists together), so nothing the
    planner counts or the rules check can be dropped on the way to the builder."""
    if model_cfg.hf_path:
        return load_spec(model_cfg.hf_path, make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by)
    from megatron_bridge.bridge.registry import get_family

    fam = get_family(model_cfg.family)
    spec_fields = {f.name for f in dataclasses.fields(BridgeSpec)}
    f = {k: getattr(model_cfg, k) for k in spec_fields if hasattr(model_cfg, k) and k not in NOT_SPEC_FIELDS}
    f.update(
        family=fam.name,
        architecture=fam.architectures[0] if fam.architectures else "",
        num_query_groups=model_cfg.kv_heads,
        head_dim=model_cfg.head_dim,
    )
    f.update(fam.implicit)
    if model_cfg.num_moe_experts:
        f["moe_ffn_hidden_size"] = model_cfg.moe_ffn_hidden_size or model_cfg.ffn_hidden_size
        if not model_cfg.moe_shared_expert_intermediate_size:
            f["moe_shared_expert_gate"] = False
    else:
        f.update(num_moe_experts=None, moe_shared_expert_intermediate_size=None)
    return BridgeSpec(**f)


def spec_to_hf_config(spec: BridgeSpec) -> dict[str, Any]:
    """A config.json for `spec` (export of a model that has no HF source directory).

    `spec_from_hf(spec_to_hf_config(s)) == s` for every supported spec; the family's
    `hf_names` / `window_key` say where its config spells things differently."""
    from megatron_bridge.bridge.registry import weight_family

    fam = weight_family(spec.family)
    names = dict(fam.hf_names)
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": fam.model_types[0],
        names.get("activation", "hidden_act"): next(k for k, v in HF_ACTIVATIONS.items() if v == spec.activation),
        "num_hidden_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.norm_epsilon,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_dropout": spec.attention_dropout,
        "initializer_range": spec.initializer_range,
        "pad_token_id": None,  # no tokenizer known; some config classes default to ids past a small vocab (Phi-3)
    }
    for f, value in (("add_qkv_bias", spec.add_qkv_bias),):
        if f in names:
            cfg[names[f]] = value
    if spec.is_moe:
        cfg[names.get("num_moe_experts", "num_experts")] = spec.num_moe_experts
        cfg["num_experts_per_tok"] = spec.moe_router_topk
        cfg[names.get("moe_ffn_hidden_size", "moe_intermediate_size")] = spec.moe_ffn_hidden_size
        if spec.moe_shared_expert_intermediate_size:
            cfg[names.get("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size")] = (
                spec.moe_shared_expert_intermediate_size
            )
        cfg["norm_topk_prob"] = not spec.moe_router_pre_softmax
        if spec.moe_layer_pattern:
            cfg["mlp_only_layers"] = [i for i, moe in enumerate(spec.moe_layer_pattern) if not moe]
            cfg["decoder_sparse_step"] = 1
    for feat in features():
        feat.to_hf(spec, cfg)
    fam.write_hf(spec, cfg)
    return cfg


__all__ = ["BridgeSpec", "spec_from_hf", "spec_to_hf_config", "load_spec", "spec_from_model_config"]
