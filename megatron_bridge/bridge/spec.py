"""`BridgeSpec`: the one description of a model, derived once from the recipe.

`backends.describe(cfg.model)` turns the recipe's model group (or the config.json it names)
into this object right after composition; every consumer — rules, planner, builder,
converter, verify, LoRA — takes it and nothing re-reads the recipe's model fields. It is frozen
and hashable (the planner caches on it).

Backend-neutral, with each backend's own part behind it: the fields every backend gives (the
dimensions the rules, the planner and the converter read, for any model) are BridgeSpec's own;
what only one backend builds from is that backend's part (`part`): `NativeArch`, the native
backend's building blocks and their settings (bridge/features/, runtime/blocks/), or
`TransformersArch`, the config.json the transformers backend rebuilds transformers' model from.
A part's fields read as the description's own (`spec.qk_layernorm` is `spec.part.qk_layernorm`);
asking a model for another backend's field is an AttributeError naming both, never a default.
`backend` names the backend that describes, builds, names and counts it (`backends/`); `name`
and `source` (the HF directory read) say where it came from and take no part in equality.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_bridge.bridge.shards import Shapes
from megatron_bridge.parallel.dims import padded_vocab_size


@dataclass(frozen=True)
class NativeArch:
    """The native backend's part: the building blocks megatron-core's GPTModel is built with
    beyond the local spec (bridge/features/, runtime/blocks/) — every default is "off" — and
    the settings the local spec itself takes. Field names are the planner's and the rules'
    vocabulary too: keep one meaning each."""

    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    sliding_window: int | None = None  # HF semantics: attend to keys with q - k < window
    window_pattern: tuple[int, ...] = ()  # per layer: 1 = sliding, 0 = full; () = all alike
    moe_shared_expert_gate: bool = False
    moe_router_pre_softmax: bool = False  # softmax over all experts, no top-k renormalisation
    moe_layer_pattern: tuple[int, ...] = ()  # 1 = MoE layer, 0 = dense; () = every layer alike
    normalization: str = "RMSNorm"
    add_bias_linear: bool = False
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
    # embeddings and head
    embedding_multiplier: float = 1.0  # input embeddings scaled (Gemma sqrt(hidden), Granite embedding_multiplier)
    residual_multiplier: float = 1.0  # sublayer outputs scaled before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    final_logit_softcapping: float | None = None  # logits -> cap·tanh(logits/cap) (Gemma 2)


@dataclass(frozen=True)
class TransformersArch:
    """The transformers backend's part: the config.json transformers' model is rebuilt from."""

    hf_json: str = (
        ""  # the transformers backend: the config.json it rebuilds transformers' config from (sorted JSON text)
    )


NATIVE_FIELDS = frozenset(f.name for f in dataclasses.fields(NativeArch))
PART_FIELDS = NATIVE_FIELDS | {f.name for f in dataclasses.fields(TransformersArch)}


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
    position_embedding_type: str = "rope"
    tie_word_embeddings: bool = False
    attention_dropout: float = 0.0
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    gated_linear_unit: bool = True  # SwiGLU (silu); false = GELU MLP
    # Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2)
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # None = q_proj directly (DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_head_dim: int = 128  # qk_nope_head_dim
    qk_pos_emb_head_dim: int = 64  # qk_rope_head_dim
    v_head_dim: int = 128
    mtp_num_layers: int = 0  # multi-token-prediction layers in the checkpoint (skipped on load, noted)
    make_vocab_size_divisible_by: int = 128
    initializer_range: float = 0.02
    # a vision-language model's vision tower and projector (first pipeline stage, whole on every TP
    # rank): their parameters, the patches one image gives the tower (0: dynamic resolution), and
    # the tower's hidden size summed over its layers (what its activations and attention scale with).
    # Derived from the config.json the description holds, so not compared.
    vision_params: int = field(default=0, compare=False)
    vision_patches: int = field(default=0, compare=False)
    vision_width: int = field(default=0, compare=False)
    # ---- the backend's own part, which backend owns the model, and where the description came from
    part: NativeArch | TransformersArch = field(default_factory=NativeArch)
    backend: str = "native"  # backends/: describes, builds, names/shards and counts it
    name: str = field(default="", compare=False)  # for messages and reports (model.name, or config.json's name)
    source: str | None = field(default=None, compare=False)  # the HF directory config.json was read from
    described_from: str = field(default="config.json", compare=False)  # or "model fields" (no config.json)

    def __getattr__(self, name: str) -> Any:
        """A part's field, read as the description's own (called only for names BridgeSpec
        itself lacks)."""
        if name.startswith("__") or "part" not in self.__dict__:  # copy / pickle probing a half-built object
            raise AttributeError(name)
        part = self.__dict__["part"]
        if name in PART_FIELDS and hasattr(part, name):
            return getattr(part, name)
        owner = (
            "the native backend's part" if name in NATIVE_FIELDS else "a backend's part" if name in PART_FIELDS else ""
        )
        raise AttributeError(
            f"{name}: {owner} of a model description; this {self.backend} model has none" if owner else name
        )

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
        """A copy with fields changed, the part's own included (`replace(qk_layernorm=True)`)."""
        own = {k: v for k, v in kw.items() if k not in PART_FIELDS}
        part = {k: v for k, v in kw.items() if k in PART_FIELDS}
        if part:
            own["part"] = dataclasses.replace(self.part, **part)
        return dataclasses.replace(self, **own)

    @classmethod
    def make(cls, **fields: Any) -> BridgeSpec:
        """A description from every field by name, its part's among them: a native model's part
        from the native fields given (defaults for the rest), a transformers model's from `hf_json`."""
        own = {k: v for k, v in fields.items() if k not in PART_FIELDS}
        native = {k: v for k, v in fields.items() if k in NATIVE_FIELDS}
        if "hf_json" in fields:
            if native:
                raise TypeError(f"a transformers model's description has no native fields: {sorted(native)}")
            return cls(**own, part=TransformersArch(fields["hf_json"]))
        return cls(**own, part=NativeArch(**native))


def field_names() -> frozenset[str]:
    """Every field that says what the model is (equality compares them): the description's own
    and its parts' — not where it came from (`name`, `source`, `described_from`)."""
    return frozenset(f.name for f in dataclasses.fields(BridgeSpec) if f.compare and f.name != "part") | PART_FIELDS
