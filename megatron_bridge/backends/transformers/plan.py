"""The transformers backend's reading of transformers' own parallel plans (torch-free).

A transformers config class declares `base_model_tp_plan` ({module pattern: style}, patterns
relative to the base model, `*` for a layer index) and `base_model_pp_plan` ({module: (inputs,
outputs)} in forward order: the embedding, maybe dropouts, the decoder layers, the final norm);
the causal-LM class adds its head (`_pp_plan`, e.g. `lm_head`). `Plan` is what the transformers backend
takes from them. `tensor_kinds` says how every checkpoint tensor is split over TP from its name
and shape alone; the weight table (core) and the builder (runtime/transformers/) both use it, so what is
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

`OVERRIDES` (backends/transformers/overrides.py, re-exported here) is the one table of what a model's
forward does outside its modules (a logit scale, ...): the transformers backend rebuilds the forward
around the modules, so each such step is declared there; a config that turns one on without an
entry is refused (`forward_refusals`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_bridge.backends.transformers.kinds import (  # re-exported: the plan's readers take them from here
    CARRY,
    CP_LAYER_KINDS,
    LAYER_KINDS,
    NO_CP_KINDS,
    UNBUILT,
    UNBUILT_KINDS,
    WHOLE_MODULES,
    cp_refusals,
    layer_limits,
    packing_refusals,
    unbuilt_refusals,
)
from megatron_bridge.backends.transformers.overrides import (  # re-exported: the plan's readers take them from here
    FORWARD,
    FORWARD_KEYS,
    MQA_QKV,
    OVERRIDES,
    PP_CONVENTION,
    Override,
    forward_refusals,
    override,
)

# base_model_ep_plan styles: the experts module (runtime/transformers/experts.py), its stacked tensors (dim 0 over EP)
EP_MODULE, EP_TENSOR = "ep_dispatch_experts", "grouped_gemm"
# the tp plan style of an experts module whose stacked tensors split over TP (runtime/transformers/experts.py)
MOE_TP = "moe_tp_experts"
# the tp plan style of a zero-compute identity expert inside `moe_tp_experts` (LongCat-Flash): its
# output is whole on every TP rank, so its input is divided by tp to count once in the experts' sum
# over TP (transformers' MoeIdentityParallel; runtime/transformers/experts.py `divide_input_by_tp`)
MOE_IDENTITY = "moe_identity_expert"
VOCAB, COLUMN, ROW, HEAD, GRAD_ALLREDUCE, REPLICATED = "vocab", "column", "row", "head", "grad_allreduce", "replicated"

# tp plan style -> what megatron layer it becomes (runtime/transformers/layers.py)
COLUMN_STYLES = ("colwise", "colwise_gather_output")
ROW_STYLES = ("rowwise", "rowwise_split_input")
# markers with no split of their own: `local_params` (a module whose parameters the plan's other
# entries already split: Granite-SWA's attention sinks, split by head here as per-head tensors)
MARKERS = ("local_params",)
# `mla_kv_a_proj` (DeepSeek-V2-style multi-head latent attention): the kv down-projection is
# whole on every rank, its output's rotary part all-reduced in backward (every rank's heads use
# it; runtime/transformers/layers.py `mla_kv_a_hook`). The latent path next to it (q down-projection,
# latent norms) feeds column-parallel linears whose input gradient megatron already sums: whole
# on every rank, gradient whole, so `replicated`, never summed again.
MLA = "mla_kv_a_proj"
MLA_LATENT = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm")
# embeddings inside a stage piece (Doge's expert embeddings, Qwen4-Exp's n-gram table; runtime/transformers/layers.py):
# `embedding_rowwise` vocab-parallel (rows split, out-of-range ids masked, output all-reduced),
# `embedding_colwise` the embedding dim split and the output all-gathered; `replicate`: whole on
# every rank with no gradient sum (transformers' TensorParallelLayer, a no-op: its input and every
# use of its output are replicated). The base model's own embedding is vocab-parallel whatever
# its entry says (`replicate` gives the same output).
EMBED_ROWS, EMBED_COLS = "embedding_rowwise", "embedding_colwise"
STYLE_KINDS = {EMBED_ROWS: COLUMN, EMBED_COLS: ROW, "replicate": REPLICATED}
STYLES = (*COLUMN_STYLES, *ROW_STYLES, "replicated_with_grad_allreduce", MLA, MQA_QKV, *STYLE_KINDS, *MARKERS)
# Sequence parallelism (runtime/transformers/layers.py): the hidden states between modules are split
# along the sequence over TP. The tp styles whose modules split so: a module holding `colwise`
# linears is gathered at its entry and closed by a `rowwise` one that scatters; per-head and
# `replicated_with_grad_allreduce` tensors sit inside it (whole sequence); experts split by
# `moe_tp_experts` gather their tokens. A unit of a decoder layer that cannot split (`sp_whole`:
# an attention planned with another style or not split at all, a layer with another style or of
# a layer kind not listed) runs whole instead: gathered at its entry, built as in plain TP, this
# rank's slice kept at its exit (runtime/transformers/layers.py `whole_under_sp`).
SP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce", MOE_TP, "packed_colwise", "packed_rowwise")
SP_LAYER_KINDS = ("full_attention", "sliding_attention")  # measured splitting under SP
# the attention modules' names in transformers' plans and decoder layers: under SP an attention
# splits only with `colwise` q/k/v (PhiMoE, HunYuan-MoE and DeepSeek-V3 plan only their MLPs
# and experts: their attention runs whole)
ATTENTION_NAMES = ("self_attn", "attention", "attn")
# what of a decoder layer runs whole under SP (`sp_whole`); the builder falls back to the layer
# where it finds no attention module of those names
WHOLE_LAYER, WHOLE_ATTENTION = "layer", "attention"


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
    # a VLM (backends/transformers/vision.py): the module whose forward merges image features into
    # the embeddings ("" the model itself) and its child that is the language model, the vision
    # pieces (first stage, whole on every TP rank), the projectors
    front: str | None = None
    language: str = ""
    vision: tuple[str, ...] = ()
    projectors: tuple[str, ...] = ()
    image_positions: str = ""  # the front's method deriving positions from the images (vision.IMAGE_POSITIONS)

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
    entries = {**extra.kind_entries(cfg), **(tp_plan or {}), **extra.tp_entries(cfg)}  # the first match wins
    tp = tuple((f"{prefix}.{k}", v) for k, v in entries.items() if v not in MARKERS)
    ep = tuple((f"{prefix}.{k}", v) for k, v in {**(ep_plan or {}), **dict(extra.ep_plan)}.items())
    return Plan(prefix, full[0], tuple(full[1:i]), full[i], tuple(full[i + 1 :]), head, tp, ep)


def plan_problems(model_type: str, tp_plan: Mapping[str, str] | None, pp_plan: Mapping[str, Any] | None) -> list[str]:
    """What this slice of the transformers backend cannot do with these plans, one line each."""
    out = []
    extra = dict(override(model_type).tp_plan)
    for _, entries in override(model_type).tp_plan_when:
        extra.update(entries)  # every variant's styles are checked
    if not tp_plan and not extra:
        out.append(
            f"{model_type}: transformers declares no base_model_tp_plan (how to split its linears) and "
            "backends/transformers/overrides.py OVERRIDES has no entry for it"
        )
    if pp_plan and "layers" not in pp_plan:
        out.append(f"{model_type}: base_model_pp_plan has no `layers` entry ({', '.join(pp_plan)})")
    for pattern, style in {**(tp_plan or {}), **extra}.items():
        if "expert" in pattern or "moe" in style:
            continue  # a model with experts is refused by its expert count (the modules exist only then)
        if style not in STYLES:
            out.append(
                f"tp plan {pattern}: {style!r} is not supported by the transformers backend yet (it maps {', '.join(STYLES)})"
            )
    return out


def sp_refusals(plan: Plan) -> list[str]:
    """What of this model cannot run under sequence parallelism, one line each: a planned module
    outside the decoder layers and the stage pieces with a style outside `SP_STYLES` (inside the
    layers `sp_whole` runs the unit whole, whatever its layer kind, and a stage piece holding such a
    style runs whole, `sp_whole_piece`; the base model's embedding reduce-scatters whatever its
    entry says)."""
    where: dict[str, list[str]] = {}
    inside = tuple(p + "." for p in (plan.layers, *plan.pre, *plan.post))
    for pattern, style in plan.tp:
        if style not in SP_STYLES and pattern != plan.embed and not pattern.startswith(inside):
            where.setdefault(style, []).append(pattern.removeprefix(plan.prefix + "."))
    return [
        f"tp style {style!r} ({', '.join(paths[:3])}) outside the decoder layers under sequence parallelism: "
        f"the transformers backend splits the sequence there around {', '.join(SP_STYLES)} only"
        for style, paths in where.items()
    ]


def sp_whole_piece(plan: Plan, path: str) -> bool:
    """Under sequence parallelism, whether stage piece `path` (one of the plan's pre or post pieces)
    runs whole: where a module in it has a tp style outside `SP_STYLES` (Qwen4-Exp's
    hyper_connection_mixer, a `rowwise_split_input` fold of its streams before the head). It is
    gathered at its entry and this rank's slice kept at its exit, as a decoder layer's unit
    (`sp_whole`); a piece with no planned module runs on the slice (a norm)."""
    if path not in (*plan.pre, *plan.post):
        return False
    return any(p.startswith(path + ".") and s not in SP_STYLES for p, s in plan.tp)


def sp_whole(plan: Plan, kind: str) -> str | None:
    """Under sequence parallelism, what of a decoder layer of layer kind `kind` runs whole: None
    where each of its modules splits the sequence, `WHOLE_ATTENTION` where its attention cannot
    (no `colwise` projection, or a style outside `SP_STYLES` in it: OLMoE's gathered q/k/v, MLA's
    whole kv down-projection), `WHOLE_LAYER` where more cannot (a style outside `SP_STYLES` next
    to the attention, a layer kind outside `SP_LAYER_KINDS`: linear attention, convolutions,
    indexers mix tokens in modules of their own). The smallest unit, so that the split modules
    (MLPs, experts) keep SP's memory saving."""
    if kind not in SP_LAYER_KINDS:
        return WHOLE_LAYER
    inside = plan.layers + ".*."
    styles = [(p.removeprefix(inside), s) for p, s in plan.tp if p.startswith(inside)]
    in_attention = {rel: rel.split(".")[0] in ATTENTION_NAMES for rel, _ in styles}
    if any(s not in SP_STYLES and not in_attention[rel] for rel, s in styles):
        return WHOLE_LAYER
    attention = [s for rel, s in styles if in_attention[rel]]
    if "colwise" not in attention or any(s not in SP_STYLES for s in attention):
        return WHOLE_ATTENTION
    return None


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
    "MOE_IDENTITY",
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
    "WHOLE_ATTENTION",
    "WHOLE_LAYER",
    "WHOLE_MODULES",
    "FORWARD",
    "cp_refusals",
    "packing_refusals",
    "forward_refusals",
    "layer_limits",
    "override",
    "plan_of",
    "plan_problems",
    "sp_refusals",
    "sp_whole",
    "sp_whole_piece",
    "tensor_kinds",
    "UNBUILT",
    "unbuilt_refusals",
]
