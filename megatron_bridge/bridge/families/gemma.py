"""Gemma 2 and Gemma 3 (text): zero-centred RMSNorms, sandwich norms around both sublayers,
GeGLU, embeddings scaled by sqrt(hidden), softmax scale query_pre_attn_scalar^-0.5, sliding
window on the layers `layer_types` names, logit soft-capping (Gemma 2; optional in Gemma 3),
per-head qk-norm (Gemma 3).

Gemma's pre_feedforward_layernorm is megatron's pre_mlp_layernorm; its post_attention /
post_feedforward norms are the sublayer post-norms of `features/sublayer.py`.

Gemma 3 text weights come in three key layouts: `model.layers...` (Gemma3ForCausalLM),
`model.language_model.layers...` (Gemma3ForConditionalGeneration as transformers 5 saves
it) and `language_model.model.layers...` (the original multimodal Hub checkpoints). A text
checkpoint cut out of a multimodal one keeps its prefix, and transformers 5's
Gemma3ForCausalLM loads neither prefixed layout (it reports every key missing), so the
gemma3_text table reads all three (prefixed rows: export=False) and writes the first.
"""

from __future__ import annotations

from collections.abc import Mapping as TMapping
from typing import Any

from megatron_bridge.bridge.families.common import L, swiglu
from megatron_bridge.bridge.mapping import QKV, REPLICATED, ROW, VOCAB
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.table import Mapping

GEMMA_IMPLICIT = {
    "zero_centered_norm": True,
    "post_attention_norm": True,
    "post_mlp_norm": True,
    "activation": "gelu_tanh",
}


def gemma_rows(model: str, qk_norm: bool, export: bool = True) -> tuple[Mapping, ...]:
    """The rows of a Gemma decoder whose HF module prefix is `model` ("model" or
    "model.language_model"); `export=False` rows are read but never written."""
    H = f"{model}.layers.{{layer}}"
    rows: tuple[Mapping, ...] = (
        Mapping("embedding.word_embeddings.weight", f"{model}.embed_tokens.weight", VOCAB, export=export),
        Mapping("decoder.final_layernorm.weight", f"{model}.norm.weight", REPLICATED, export=export),
        Mapping("output_layer.weight", f"{model}.embed_tokens.weight", VOCAB, when="tie_word_embeddings", export=False),
        Mapping(f"{L}.input_layernorm.weight", f"{H}.input_layernorm.weight", REPLICATED, export=export),
        Mapping(
            f"{L}.self_attention.linear_qkv.weight",
            (f"{H}.self_attn.q_proj.weight", f"{H}.self_attn.k_proj.weight", f"{H}.self_attn.v_proj.weight"),
            QKV,
            export=export,
        ),
        Mapping(f"{L}.self_attention.linear_proj.weight", f"{H}.self_attn.o_proj.weight", ROW, export=export),
        Mapping(
            f"{L}.self_attention.post_layernorm.weight",
            f"{H}.post_attention_layernorm.weight",
            REPLICATED,
            export=export,
        ),
        Mapping(f"{L}.pre_mlp_layernorm.weight", f"{H}.pre_feedforward_layernorm.weight", REPLICATED, export=export),
        Mapping(f"{L}.mlp.post_layernorm.weight", f"{H}.post_feedforward_layernorm.weight", REPLICATED, export=export),
    )
    mlp = tuple(Mapping(m.megatron, m.hf, m.transform, export=export) for m in swiglu(f"{L}.mlp", f"{H}.mlp"))
    if qk_norm:
        rows += (
            Mapping(
                f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight", REPLICATED, export=export
            ),
            Mapping(
                f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight", REPLICATED, export=export
            ),
        )
    return rows + mlp


LM_HEAD = (Mapping("output_layer.weight", "lm_head.weight", VOCAB, when="!tie_word_embeddings"),)


class _Gemma(FamilyBridge):
    implicit = GEMMA_IMPLICIT
    hf_names = {"activation": "hidden_activation"}
    window_key = "layer_types"

    sliding_every = 2  # transformers' default layer_types: every n-th layer full, the others sliding
    pattern_key: str | None = None  # the config key that overrides sliding_every (Gemma 3)

    @classmethod
    def complete_hf(cls, hf: TMapping[str, Any]) -> TMapping[str, Any]:
        """Configs written before transformers 5 have no layer_types (the config class derives
        them) and may carry a stale hidden_act next to the hidden_activation Gemma uses."""
        out = dict(hf)
        if "hidden_activation" in out:
            out["hidden_act"] = out["hidden_activation"]
        if not out.get("layer_types") and out.get("num_hidden_layers"):
            n = int((out.get(cls.pattern_key) if cls.pattern_key else None) or cls.sliding_every)
            kinds = ["sliding_attention" if (i + 1) % n else "full_attention" for i in range(out["num_hidden_layers"])]
            out["layer_types"] = kinds
        return out

    @classmethod
    def read_hf(cls, hf: TMapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        fields["embedding_multiplier"] = float(hf["hidden_size"]) ** 0.5
        fields["softmax_scale"] = float(hf.get("query_pre_attn_scalar", 256)) ** -0.5
        if hf.get("use_bidirectional_attention"):
            problems.append("use_bidirectional_attention=true (bidirectional Gemma) is not supported")

    @classmethod
    def write_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        scalar = spec.softmax_scale**-2 if spec.softmax_scale else spec.head_dim
        cfg["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2 defaults them to on
            cfg.setdefault(key, None)


@register
class Gemma2(_Gemma):
    name = "gemma2"
    tiny = (
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
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("gemma2",)
    architectures = ("Gemma2ForCausalLM",)
    table = gemma_rows("model", qk_norm=False) + LM_HEAD
    notes = "zero-centred sandwich norms, GeGLU, logit soft-capping, alternating sliding window"


@register
class Gemma3Text(_Gemma):
    name = "gemma3_text"
    tiny = (
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
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("gemma3_text",)
    architectures = ("Gemma3ForCausalLM",)
    implicit = {**GEMMA_IMPLICIT, "qk_layernorm": True}
    sliding_every = 6
    pattern_key = "sliding_window_pattern"
    table = (
        gemma_rows("model", qk_norm=True)
        + gemma_rows("model.language_model", qk_norm=True, export=False)
        + gemma_rows("language_model.model", qk_norm=True, export=False)
        + LM_HEAD
    )
    notes = "as gemma2 plus zero-centred qk-norm, a rope base per layer type (rope_local_base_freq)"

    @classmethod
    def write_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        """Gemma 3 configs always nest rope per layer type (features/rope.py nests it only
        when the sliding layers' base differs)."""
        super().write_hf(spec, cfg)
        if "full_attention" not in cfg["rope_parameters"]:
            local = {"rope_type": "default", "rope_theta": spec.rope_local_base or spec.rotary_base}
            cfg["rope_parameters"] = {"full_attention": cfg["rope_parameters"], "sliding_attention": local}
