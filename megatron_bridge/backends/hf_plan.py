"""The hf backend's reading of transformers' own parallel plans (torch-free).

A transformers config class declares `base_model_tp_plan` ({module pattern: style}, patterns
relative to the base model, `*` for a layer index) and `base_model_pp_plan` ({module: (inputs,
outputs)} in forward order: the embedding, maybe dropouts, the decoder layers, the final norm);
the causal-LM class adds its head (`_pp_plan`, e.g. `lm_head`). `Plan` is what the hf backend
takes from them. `tensor_kinds` says how every checkpoint tensor is split over TP from its name
and shape alone; the weight table (core) and the builder (runtime/hf/) both use it, so what is
loaded is what is built:

| kind | tensors | split |
|---|---|---|
| `vocab` | the embedding, the LM head (weight and bias) | rows over TP after padding the vocab (megatron's VocabParallelEmbedding / column-parallel head) |
| `column` | weight and bias of a `colwise` / `colwise_gather_output` linear | output rows |
| `row` | weight of a `rowwise` / `rowwise_split_input` linear | input columns (its bias is `replicated`) |
| `column` / `row` | weight of an `embedding_rowwise` / `embedding_colwise` embedding inside a stage piece | rows (vocab-parallel) / columns (embedding dim) |
| `head` | an unplanned per-head tensor ([heads or kv-heads, head_dim]) next to a split attention | by head |
| `grad_allreduce` | a `replicated_with_grad_allreduce` module's tensors, and any other unplanned tensor next to a split `colwise` linear | whole on every rank; its gradient summed over TP |
| `replicated` | everything else (norms, row-parallel biases) | whole on every rank |

`OVERRIDES` is the one table of what a model's forward does outside its modules (a logit scale,
...): the hf backend rebuilds the forward around the modules, so each such step is declared
here; a config that turns one on without an entry is refused (`forward_refusals`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_bridge.backends.hf_kinds import (  # re-exported: the plan's readers take them from here
    CARRY,
    CP_LAYER_KINDS,
    LAYER_KINDS,
    NO_CP_KINDS,
    UNBUILT,
    UNBUILT_KINDS,
    WHOLE_MODULES,
    cp_refusals,
    layer_limits,
    unbuilt_refusals,
)

# base_model_ep_plan styles: the experts module (runtime/hf/experts.py), its stacked tensors (dim 0 over EP)
EP_MODULE, EP_TENSOR = "ep_dispatch_experts", "grouped_gemm"
# the tp plan style of an experts module whose stacked tensors split over TP (runtime/hf/experts.py)
MOE_TP = "moe_tp_experts"
VOCAB, COLUMN, ROW, HEAD, GRAD_ALLREDUCE, REPLICATED = "vocab", "column", "row", "head", "grad_allreduce", "replicated"

# tp plan style -> what megatron layer it becomes (runtime/hf/layers.py)
COLUMN_STYLES = ("colwise", "colwise_gather_output")
ROW_STYLES = ("rowwise", "rowwise_split_input")
# markers with no split of their own: `local_params` (a module whose parameters the plan's other
# entries already split: Granite-SWA's attention sinks, split by head here as per-head tensors)
MARKERS = ("local_params",)
# `mla_kv_a_proj` (DeepSeek-V2-style multi-head latent attention): the kv down-projection is
# whole on every rank, its output's rotary part all-reduced in backward (every rank's heads use
# it; runtime/hf/layers.py `mla_kv_a_hook`). The latent path next to it (q down-projection,
# latent norms) feeds column-parallel linears whose input gradient megatron already sums: whole
# on every rank, gradient whole, so `replicated`, never summed again.
MLA = "mla_kv_a_proj"
MLA_LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")
# embeddings inside a stage piece (Doge's expert embeddings, Qwen4-Exp's n-gram table; runtime/hf/layers.py):
# `embedding_rowwise` vocab-parallel (rows split, out-of-range ids masked, output all-reduced),
# `embedding_colwise` the embedding dim split and the output all-gathered; `replicate`: whole on
# every rank with no gradient sum (transformers' TensorParallelLayer, a no-op: its input and every
# use of its output are replicated). The base model's own embedding is vocab-parallel whatever
# its entry says (`replicate` gives the same output).
EMBED_ROWS, EMBED_COLS = "embedding_rowwise", "embedding_colwise"
STYLE_KINDS = {EMBED_ROWS: COLUMN, EMBED_COLS: ROW, "replicate": REPLICATED}
# `mqa_fused_qkv` (the hf backend's own plan string, from OVERRIDES only): a fused projection laid
# out [query heads..., key, value] with one K/V head for every query head (Falcon's multi-query
# attention). One head does not split over TP, so the linear stays whole on every rank and each
# rank keeps its query heads and the K/V head of the output (runtime/hf/layers.py `mqa_qkv_hooks`);
# its input's gradient is summed over TP as a column-parallel linear's is, its weight's too
# (`grad_allreduce`: each rank's part of the gradient comes from its own heads).
MQA_QKV = "mqa_fused_qkv"
STYLES = (*COLUMN_STYLES, *ROW_STYLES, "replicated_with_grad_allreduce", MLA, MQA_QKV, *STYLE_KINDS, *MARKERS)
# Sequence parallelism (runtime/hf/layers.py): the hidden states between modules are split
# along the sequence over TP. The tp styles whose modules run so: a module holding `colwise`
# linears is gathered at its entry and closed by a `rowwise` one that scatters; per-head and
# `replicated_with_grad_allreduce` tensors sit inside it (whole sequence); experts split by
# `moe_tp_experts` gather their tokens. Any other style (an output gathered over TP, an input
# split, MLA's whole kv down-projection on the residual stream) is refused under SP, as is a
# layer kind not listed (a module mixing tokens outside a gathered module would see a slice).
SP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", MOE_TP, "packed_colwise", "packed_rowwise")
SP_LAYER_KINDS = ("full_attention", "sliding_attention")  # measured under SP
# the attention modules' names in transformers' plans: under SP the attention must be split
# (`colwise` q/k/v), or it would run whole on each rank's slice of the sequence (PhiMoE,
# HunYuan-MoE and DeepSeek-V3 plan only their MLPs and experts)
ATTENTION_NAMES = ("self_attn", "attention", "attn")


@dataclass(frozen=True)
class Override:
    """What one model type's forward does outside its modules, that a stage must redo; each
    field names the config key that holds the constant (checked by `mbr verify --matrix
    model.backend=hf`, docs/bridge.md)."""

    reason: str = ""  # where transformers' forward does it
    logit_scale: str | None = None  # config key: logits multiplied by it
    logit_divide: str | None = None  # config key: logits divided by it
    logit_softcap: str | None = None  # config key c: logits = c * tanh(logits / c)
    embed_scale: str | None = None  # config key: the embeddings multiplied by it (first stage)
    embed_sqrt_hidden: str | None = None  # config key of a flag: when on, embeddings * sqrt(hidden_size) (muP)
    tp_plan: tuple[tuple[str, str], ...] = ()  # extra or replacement plan entries (models without a plan)
    pp_plan: tuple[str, ...] = ()  # the base model's stage pieces in forward order (over its base_model_pp_plan)
    # stage pieces kept (weights loaded, exported, no gradient) but not called: for a text-only batch they
    # return the embeddings unchanged (Phi-4-multimodal's embed_tokens_extend merges image/audio embeddings)
    text_identity: tuple[str, ...] = ()
    # (decoder-layer kwarg, function of position_ids in the modeling module) the forward passes to
    # the layers whose layer kind has no rotary embedding (Beam's NoPE query scale)
    nope_kwargs: tuple[tuple[str, str], ...] = ()
    window_full_attention: str | None = (
        None  # config key: when set, `full_attention` layers take the sliding-window mask
    )
    prefix: str | None = None  # the base model's attribute, where the class's base_model_prefix names none
    # (config key of the stream count n, the base model's module that folds them): the forward runs
    # the layers on n hyper-connection streams [b, s, n, h] (the embeddings repeated n times on the
    # first stage), folded by that module before the post pieces (HY-V4's hc_mult, hc_head)
    streams: tuple[str, str] | None = None
    # rope types (keys of config.rope_parameters): every layer takes position_embeddings as the dict
    # {type: rotary(x, position_ids, type)} and picks its own (DeepSeek-V4's 'main' / 'compress')
    rotary_types: tuple[str, ...] = ()
    # the chunk's forward inputs the model's forward hands every layer by name (DeepSeek-V4's
    # hash-routed MoE reads input_ids); every stage has them (megatron's schedule feeds each stage)
    layer_inputs: tuple[str, ...] = ()
    layers: str = "layers"  # the pp plan's piece that is the ModuleList of decoder layers
    # (the base model's ModuleList of rotary modules, the config's per-layer list): layer i takes the
    # rotary module of its value, the list holding one per distinct non-zero value in ascending
    # order; 0 means no rotary (NoPE). Granite-MoE-SWA's rotary_embs by layer_rope_theta.
    layer_rotary: tuple[str, str] | None = None
    # (kwarg, value) every decoder layer is called with, where its forward takes it without a default
    layer_kwargs: tuple[tuple[str, Any], ...] = ()
    # (config key, why): a config with the key truthy is refused, naming it (a feature the stages do not rebuild)
    refused: tuple[tuple[str, str], ...] = ()
    # ({config key: value, ...}, tp plan entries): entries that replace tp_plan's where the config matches
    # (a fused projection whose layout follows a config flag)
    tp_plan_when: tuple[tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, str], ...]], ...] = ()

    def tp_entries(self, cfg: Any = None) -> dict[str, str]:
        """tp_plan with the `tp_plan_when` entries whose config values `cfg` (an object) holds."""
        out = dict(self.tp_plan)
        for when, entries in self.tp_plan_when:
            if cfg is not None and all(getattr(cfg, k, None) == v for k, v in when):
                out.update(entries)
        return out

    def handled(self) -> set[str | None]:
        return {self.logit_scale, self.logit_divide, self.logit_softcap, self.embed_scale, self.embed_sqrt_hidden}

    def constants(self, cfg: Any) -> dict[str, float]:
        """{FORWARD field: value} that the chunk's forward applies, read off the transformers config."""
        out = {k: float(getattr(cfg, v)) for k in FORWARD if (v := getattr(self, k))}
        if self.embed_sqrt_hidden and getattr(cfg, self.embed_sqrt_hidden):
            out["embed_scale"] = out.get("embed_scale", 1.0) * float(cfg.hidden_size) ** 0.5
        return out

    def stream_count(self, cfg: Any) -> int:
        """How many hyper-connection streams the layers run on (1: one plain stream)."""
        return int(getattr(cfg, self.streams[0])) if self.streams else 1


# the Override fields that hold a config key of a constant the chunk's forward applies
FORWARD = ("logit_scale", "logit_divide", "logit_softcap", "embed_scale")
# the stage pieces of a model that declares no base_model_pp_plan: transformers' own convention
# (`base_model_pp_plan = {"embed_tokens": ..., "layers": ..., "norm": ...}`), taken where the base
# model has exactly these children with weights (`hf.model_plan` checks, and refuses the others)
PP_CONVENTION = ("embed_tokens", "layers", "norm")
_SOFTCAP = "CausalLM.forward: logits / c, tanh, * c"
OVERRIDES: dict[str, Override] = {
    "llama4_text": Override(
        "Llama4ForCausalLM.base_model_prefix is `language_model` (its composite parent's name); it holds `model`",
        prefix="model",
    ),
    "cohere": Override("CohereForCausalLM.forward: logits * logit_scale", logit_scale="logit_scale"),
    "cohere2": Override("Cohere2ForCausalLM.forward: logits * logit_scale", logit_scale="logit_scale"),
    "gemma2": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    "vaultgemma": Override(_SOFTCAP, logit_softcap="final_logit_softcapping"),
    "granite": Override(
        "GraniteModel.forward: embeddings * embedding_multiplier; GraniteForCausalLM: logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "nanochat": Override(
        "no base_model_pp_plan: its model norms (weightless RMSNorm) before and after the layers; "
        "CausalLM.forward softcaps the logits",
        pp_plan=("embed_tokens", "norm", "layers", "norm"),
        logit_softcap="final_logit_softcapping",
    ),
    "minicpm3": Override(
        "MiniCPM3ForCausalLM.forward: hidden states / logits_scaling before the (bias-free) LM head",
        logit_divide="logits_scaling",
    ),
    "granite_swa": Override(
        "as granite: embeddings * embedding_multiplier, logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "granitemoe": Override(
        "as granite: GraniteMoeModel.forward: embeddings * embedding_multiplier; its CausalLM: logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "granitemoeshared": Override(
        "as granite: embeddings * embedding_multiplier, logits / logits_scaling",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
    ),
    "granitemoe_swa": Override(
        "as granite: embeddings * embedding_multiplier, logits / logits_scaling; no base_model_pp_plan, its "
        "model holds one rotary module per distinct layer_rope_theta (rotary_embs; 0: NoPE) beside the convention",
        embed_scale="embedding_multiplier",
        logit_divide="logits_scaling",
        pp_plan=PP_CONVENTION,
        layer_rotary=("rotary_embs", "layer_rope_theta"),
    ),
    "cohere2_moe": Override("Cohere2MoeForCausalLM.forward: logits * logit_scale", logit_scale="logit_scale"),
    "afmoe": Override(
        "AfmoeModel.forward: embeddings * hidden_size**0.5 when mup_enabled (muP input scaling)",
        embed_sqrt_hidden="mup_enabled",
    ),
    "beam": Override(
        "BeamForCausalLM.forward softcaps the logits; BeamModel.forward passes NoPE (full-attention) layers "
        "attention_scaling=compute_attention_scaling(position_ids)",
        logit_softcap="final_logit_softcapping",
        nope_kwargs=(("attention_scaling", "compute_attention_scaling"),),
    ),
    "minimax": Override(
        "MiniMaxModel.forward: the full-attention layers' mask is the sliding-window one when sliding_window is set",
        window_full_attention="sliding_window",
    ),
    "lfm2_moe": Override(
        "no base_model_pp_plan: its final norm is named embedding_norm (Lfm2MoeModel.forward applies it after the layers)",
        pp_plan=("embed_tokens", "layers", "embedding_norm"),
    ),
    "hy_v4": Override(
        "HYV4Model.forward runs the layers on hc_mult hyper-connection streams ([b, s, hc_mult, h], the "
        "embeddings repeated) and folds them with hc_head before the norm",
        streams=("hc_mult", "hc_head"),
    ),
    "deepseek_v4": Override(
        "DeepseekV4Model.forward runs the layers on hc_mult hyper-connection streams folded by hc_head before "
        "the norm, hands every layer the {'main', 'compress'} rotary pair and input_ids (hash-routed MoE)",
        streams=("hc_mult", "hc_head"),
        rotary_types=("main", "compress"),
        layer_inputs=("input_ids",),
    ),
    "nemotron_h": Override(
        "no base_model_pp_plan: NemotronHModel.forward runs embeddings -> layers -> norm_f",
        pp_plan=("embeddings", "layers", "norm_f"),
    ),
    "falcon": Override(
        "no base_model_tp_plan or pp_plan: FalconModel is word_embeddings -> h -> ln_f; query_key_value is "
        "fused per K/V group ([H/G query heads, key, value] x G: per head with G = H by default, "
        "new_decoder_architecture's num_kv_heads groups), so a row split gives each rank whole groups; "
        "multi_query's one K/V head (after all query heads) stays whole (mqa_fused_qkv); the decoder "
        "layer takes `alibi` positionally (None: rotary)",
        tp_plan=(
            ("h.*.self_attention.query_key_value", "colwise"),
            ("h.*.self_attention.dense", "rowwise"),
            ("h.*.mlp.dense_h_to_4h", "colwise"),
            ("h.*.mlp.dense_4h_to_h", "rowwise"),
        ),
        tp_plan_when=(
            (
                (("multi_query", True), ("new_decoder_architecture", False)),
                (("h.*.self_attention.query_key_value", MQA_QKV),),
            ),
        ),
        pp_plan=("word_embeddings", "h", "ln_f"),
        layers="h",
        layer_kwargs=(("alibi", None),),
        refused=(
            (
                "alibi",
                "FalconModel.forward adds the ALiBi bias (per head, from the padding mask) to the attention "
                "mask; the hf backend's stages build plain causal masks",
            ),
        ),
    ),
    "jamba": Override(
        "no base_model_pp_plan: JambaModel.forward applies its final norm, named final_layernorm, after the layers",
        pp_plan=("embed_tokens", "layers", "final_layernorm"),
    ),
    "phi4_multimodal": Override(
        "Phi4MultimodalModel.forward runs embed_tokens_extend (the vision and audio encoders) after the embedding; "
        "with no image or audio input it returns the text embeddings unchanged",
        pp_plan=("embed_tokens", "embed_tokens_extend", "layers", "norm"),
        text_identity=("embed_tokens_extend",),
    ),
    "hyperclovax": Override(
        "HyperCLOVAXModel.forward: embeddings * embedding_multiplier; its CausalLM: logits * logits_scaling (muP)",
        embed_scale="embedding_multiplier",
        logit_scale="logits_scaling",
    ),
}
# config keys that switch on forward-level arithmetic; without an override entry they are refused
FORWARD_KEYS = (
    "logit_scale",
    "logits_scaling",
    "embedding_multiplier",
    "final_logit_softcapping",
    "embedding_scale",
    "mup_enabled",
)
# model types whose forward does arithmetic no config key announces (gemma's sqrt(hidden) embedding
# scale is its ScaledWordEmbedding module's, which the hf backend keeps: runtime/hf/build.py)
FORWARD_MATH: dict[str, str] = {
    "inkling2_text": "Inkling2ForCausalLM.forward slices the (softcapped) logits to unpadded_vocab_size, and its "
    "embed_tokens is an Inkling2NormedEmbedding (a norm inside the embedding, not nn.Embedding)",
    "doge": "DogeCDMoE.forward views the router logits of all batch x sequence tokens as (2, tokens, -1), mixing "
    "tokens across the batch (transformers' own note), so its outputs depend on the micro-batch split; and its "
    "dt_proj (rowwise) hands every TP rank all kv heads' mask values for its own heads",
    "gemma3n_text": "Gemma3nTextModel.forward: per-layer inputs (embed_tokens_per_layer, per_layer_model_projection) "
    "fed to every layer, and AltUp's stack of altup_num_inputs hidden states carried between the layers",
    "hrm_text": "HrmTextModel.forward: the H/L-cycle recurrence (L_module and H_module stacks run H_cycles x "
    "L_cycles times on carried states, no one list of decoder layers to stage)",
}


def override(model_type: str) -> Override:
    return OVERRIDES.get(model_type, Override())


def forward_refusals(model_type: str, hf: Mapping[str, Any]) -> list[str]:
    """One line per piece of forward arithmetic the hf backend would drop for this config."""
    out = []
    if model_type in FORWARD_MATH:
        out.append(f"{FORWARD_MATH[model_type]} (no entry in backends/hf_plan.py OVERRIDES)")
    handled = override(model_type).handled()
    out += [
        f"{key}=True: {why} (backends/hf_plan.py OVERRIDES)" for key, why in override(model_type).refused if hf.get(key)
    ]
    for key in FORWARD_KEYS:
        v = hf.get(key)
        if key not in handled and (v is True or v not in (None, 0, 1, 1.0, False)):  # a flag, or a constant
            out.append(f"{key}={v!r} is applied in the model's forward (no entry in backends/hf_plan.py OVERRIDES)")
    return out


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")


def _match(entries: tuple[tuple[str, str], ...], path: str) -> str | None:
    for pattern, style in entries:
        if _regex(pattern).match(path):
            return style
    return None


@dataclass(frozen=True)
class Plan:
    """The module paths a stage is made of and every planned linear's style.

    Paths of the base model's pieces are relative to the causal LM (`model.embed_tokens`);
    `tp` patterns too (`model.layers.*.self_attn.q_proj`)."""

    prefix: str  # the base model's attribute ("model", "gpt_neox")
    embed: str  # the embedding
    pre: tuple[str, ...]  # modules between the embedding and the layers (dropouts), in order
    layers: str  # the ModuleList of decoder layers
    post: tuple[str, ...]  # modules after the layers (the final norm), in order
    head: str  # the LM head ("lm_head")
    tp: tuple[tuple[str, str], ...]  # (module pattern, style)
    ep: tuple[tuple[str, str], ...] = ()  # base_model_ep_plan: (module or tensor pattern, style)

    def style(self, module: str) -> str | None:
        """The tp style of the module at `module` (a path in the causal LM), None if unplanned."""
        return _match(self.tp, module)

    def ep_style(self, path: str) -> str | None:
        """The ep style of a module or tensor (`ep_dispatch_experts`, `grouped_gemm`), None if unplanned."""
        return _match(self.ep, path)

    def layer_index(self, name: str) -> int | None:
        m = re.match(re.escape(self.layers) + r"\.(\d+)\.", name)
        return int(m.group(1)) if m else None

    def template(self, name: str) -> str:
        """`name` with its layer index as the table's `{layer}` hole."""
        return re.sub("^" + re.escape(self.layers) + r"\.\d+\.", self.layers + ".{layer}.", name)


def plan_of(
    model_type: str,
    prefix: str,
    tp_plan: Mapping[str, str] | None,
    pp_plan: Mapping[str, Any] | None,
    head_plan: Iterable[str],
    ep_plan: Mapping[str, str] | None = None,
    cfg: Any = None,
) -> Plan:
    """The plan from the config's `base_model_tp_plan` / `base_model_pp_plan` (and the model
    type's override entries), the causal-LM class's head plan and its `base_model_prefix`
    (the caller checked `plan_problems` first); `cfg`, the transformers config, picks `tp_plan_when` entries."""
    extra = override(model_type)
    pieces = list(extra.pp_plan or pp_plan or PP_CONVENTION)
    assert extra.layers in pieces, "plan_problems refuses a model without a usable pp plan"
    i = pieces.index(extra.layers)
    if extra.streams:  # the streams' fold runs first after the layers (Override.streams)
        pieces.insert(i + 1, extra.streams[1])
    full = [f"{prefix}.{n}" for n in pieces]
    head = next(iter(head_plan), "lm_head")
    entries = {**(tp_plan or {}), **extra.tp_entries(cfg)}
    tp = tuple((f"{prefix}.{k}", v) for k, v in entries.items() if v not in MARKERS)
    ep = tuple((f"{prefix}.{k}", v) for k, v in (ep_plan or {}).items())
    return Plan(prefix, full[0], tuple(full[1:i]), full[i], tuple(full[i + 1 :]), head, tp, ep)


def plan_problems(model_type: str, tp_plan: Mapping[str, str] | None, pp_plan: Mapping[str, Any] | None) -> list[str]:
    """What this slice of the hf backend cannot do with these plans, one line each."""
    out = []
    extra = dict(override(model_type).tp_plan)
    for _, entries in override(model_type).tp_plan_when:
        extra.update(entries)  # every variant's styles are checked
    if not tp_plan and not extra:
        out.append(
            f"{model_type}: transformers declares no base_model_tp_plan (how to split its linears) and "
            "backends/hf_plan.py OVERRIDES has no entry for it"
        )
    if pp_plan and "layers" not in pp_plan:
        out.append(f"{model_type}: base_model_pp_plan has no `layers` entry ({', '.join(pp_plan)})")
    for pattern, style in {**(tp_plan or {}), **extra}.items():
        if "expert" in pattern or "moe" in style:
            continue  # a model with experts is refused by its expert count (the modules exist only then)
        if style not in STYLES:
            out.append(
                f"tp plan {pattern}: {style!r} is not supported by the hf backend yet (it maps {', '.join(STYLES)})"
            )
    return out


def sp_refusals(plan: Plan, layer_kinds: Iterable[str]) -> list[str]:
    """What of this model cannot run under sequence parallelism (`SP_STYLES`), one line each."""
    where: dict[str, list[str]] = {}
    for pattern, style in plan.tp:
        if style not in SP_STYLES and pattern != plan.embed:  # the embedding reduce-scatters (runtime/hf/layers.py)
            where.setdefault(style, []).append(pattern.removeprefix(plan.prefix + "."))
    out = [
        f"tp style {style!r} ({', '.join(paths[:3])}) under sequence parallelism: the hf backend splits "
        f"the sequence around {', '.join(SP_STYLES)} only"
        for style, paths in where.items()
    ]
    attention = [p for p, style in plan.tp if style == "colwise" and any(n in p for n in ATTENTION_NAMES)]
    if not attention:
        out.append(
            "sequence parallelism needs the attention split over TP, and the tp plan names no `colwise` "
            f"attention projection (under {', '.join(ATTENTION_NAMES)})"
        )
    out += [
        f"layer kind {kind!r} under sequence parallelism (the hf backend gathers the sequence for "
        f"{', '.join(SP_LAYER_KINDS)} only)"
        for kind in dict.fromkeys(layer_kinds)
        if kind not in SP_LAYER_KINDS
    ]
    return out


def tensor_kinds(
    plan: Plan, shapes: Mapping[str, tuple[int, ...]], heads: int, kv_heads: int, head_dim: int
) -> dict[str, str]:
    """{tensor name: kind} for every parameter / persistent buffer of the causal LM (names as
    transformers has them, global layer indices). See the module docstring for the kinds."""
    modules = {n.rpartition(".")[0] for n in shapes}
    styles = {m: s for m in modules if (s := plan.style(m)) is not None}
    split_parents = {m.rpartition(".")[0] for m, s in styles.items() if s == "colwise"}
    latent = {f"{m.rpartition('.')[0]}.{leaf}" for m, s in styles.items() if s == MLA for leaf in MLA_LATENT}
    per_head = {heads, kv_heads}
    out = {}
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        style = styles.get(module)
        if module in (plan.embed, plan.head):
            kind = VOCAB
        elif style in COLUMN_STYLES:
            kind = COLUMN
        elif style in ROW_STYLES:
            kind = ROW if leaf == "weight" else REPLICATED
        elif style in ("replicated_with_grad_allreduce", MQA_QKV):
            kind = GRAD_ALLREDUCE
        elif style in STYLE_KINDS:
            kind = STYLE_KINDS[style]
        elif style == MLA or module in latent or any(part in WHOLE_MODULES for part in module.split(".")):
            kind = REPLICATED
        elif any(module == p or module.startswith(p + ".") for p in split_parents) and not any(
            module.startswith(m + ".") for m in styles
        ):
            two_d = len(shape) == 2 and shape[0] in per_head and shape[1] == head_dim
            one_d = len(shape) == 1 and shape[0] in per_head and shape[0] != head_dim
            kind = HEAD if two_d or one_d else GRAD_ALLREDUCE
        else:
            kind = REPLICATED
        out[name] = kind
    return out


__all__ = [
    "ATTENTION_NAMES",
    "CARRY",
    "COLUMN",
    "COLUMN_STYLES",
    "CP_LAYER_KINDS",
    "EMBED_COLS",
    "EMBED_ROWS",
    "EP_MODULE",
    "EP_TENSOR",
    "MOE_TP",
    "FORWARD",
    "FORWARD_KEYS",
    "GRAD_ALLREDUCE",
    "HEAD",
    "LAYER_KINDS",
    "MLA",
    "MLA_LATENT",
    "MQA_QKV",
    "NO_CP_KINDS",
    "OVERRIDES",
    "Override",
    "PP_CONVENTION",
    "Plan",
    "REPLICATED",
    "ROW",
    "ROW_STYLES",
    "SP_LAYER_KINDS",
    "SP_STYLES",
    "STYLES",
    "STYLE_KINDS",
    "UNBUILT_KINDS",
    "VOCAB",
    "WHOLE_MODULES",
    "FORWARD",
    "cp_refusals",
    "forward_refusals",
    "layer_limits",
    "override",
    "plan_of",
    "plan_problems",
    "sp_refusals",
    "tensor_kinds",
    "UNBUILT",
    "unbuilt_refusals",
]
