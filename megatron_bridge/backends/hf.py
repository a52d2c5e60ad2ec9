"""`hf`: transformers' own modeling code under megatron's parallel layers and schedules.

For an architecture with no native family: the causal-LM class transformers has for the
config's `model_type` is built on the meta device, each pipeline stage keeps its pieces of the
model (`hf_plan.Plan`, from transformers' `base_model_pp_plan`), and every linear the
`base_model_tp_plan` names becomes megatron's column/row-parallel linear holding its shard
(runtime/hf/); MoE experts modules are split over EP (backends/hf_experts.py). This slice covers
decoder-only models at TP and PP, and MoE at EP·PP without TP (docs/bridge.md, "The hf
backend"); what it cannot do yet is refused here, one line each.

The description keeps the common dimensions (`bridge.hf_config.HF_KEYS`, read from
transformers' config object, so its defaults count) for the rules and the planner, and the
config.json itself (`BridgeSpec.hf_json`) for the builder. The weight table and the parameter
count come from the meta-device model: exact, with transformers' own names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from megatron_bridge.backends.base import Backend
from megatron_bridge.backends.hf_aux import aux_limits
from megatron_bridge.backends.hf_experts import (
    EXPERT_TP_PACKS,
    EXPERT_TP_SPLITS,
    StackedExperts,
    WholeStackedExperts,
    expert_fields,
    expert_limits,
    stacked,
)
from megatron_bridge.backends.hf_plan import (
    COLUMN,
    GRAD_ALLREDUCE,
    HEAD,
    LAYER_KINDS,
    MOE_TP,
    PP_CONVENTION,
    REPLICATED,
    ROW,
    UNBUILT_KINDS,
    VOCAB,
    Plan,
    cp_refusals,
    forward_refusals,
    layer_limits,
    override,
    plan_of,
    plan_problems,
    sp_refusals,
    tensor_kinds,
    unbuilt_refusals,
)
from megatron_bridge.bridge.hf_config import UnsupportedFeatures, base_fields
from megatron_bridge.bridge.mapping import COLUMN as COLUMN_T
from megatron_bridge.bridge.mapping import REPLICATED as REPLICATED_T
from megatron_bridge.bridge.mapping import ROW as ROW_T
from megatron_bridge.bridge.mapping import SCALAR as SCALAR_T
from megatron_bridge.bridge.mapping import VOCAB as VOCAB_T
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping as Row
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.dims import padded_vocab_size
from megatron_bridge.plan.params import ParamCount

TRANSFORMS = {
    VOCAB: VOCAB_T,
    COLUMN: COLUMN_T,
    HEAD: COLUMN_T,
    ROW: ROW_T,
    GRAD_ALLREDUCE: REPLICATED_T,
    REPLICATED: REPLICATED_T,
}


def causal_lm_class_name(model_type: str) -> str | None:
    """transformers' causal-LM class for `model_type`, None if it has none."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def config_object(hf: Mapping[str, Any]) -> Any:
    """transformers' config object of a parsed config.json (its class's defaults filled in).
    config.json writes non-finite floats as {"__float__": "Infinity"} (Mamba's time_step_limit);
    they are decoded as transformers' own reader does, or the strict config class refuses them."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[hf["model_type"]]
    return runs_on(hf["model_type"], cls.from_dict(cls._decode_special_floats(dict(hf))))


def runs_on(model_type: str, cfg: Any) -> Any:
    """The config the causal-LM class runs on: a composite config (llama4's, its text_config
    inside) gives its text config where the causal LM is declared on that class, as
    AutoModelForCausalLM.from_config does; the other sub-configs (vision) build nothing."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    text_cls = getattr(cfg, "sub_configs", {}).get("text_config")
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(cfg), None)
    if text_cls is not None and getattr(model_cls, "config_class", None) == text_cls:
        return cfg.get_text_config()
    return cfg


def declared(cfg: Any) -> dict[str, Any]:
    """The config's values for the fields its class declares (defaults filled in): a key the
    class does not know (`num_key_value_heads` in a GPT-NeoX config.json) is kept by
    transformers but used by nothing, so it must not describe the model."""
    cls = type(cfg)
    known = set(getattr(cls, "attribute_map", {}) or {})
    return {k: v for k, v in cfg.to_dict().items() if hasattr(cls, k) or k in known}


def transformers_config(spec: BridgeSpec) -> Any:
    """The config object the hf backend builds `spec` from."""
    return config_object(json.loads(spec.hf_json))


def model_plan(model: Any) -> Plan:
    """The plan of a built (meta or real) transformers causal LM."""
    cfg = model.config
    head = getattr(type(model), "_pp_plan", None) or {}
    if not cfg.base_model_pp_plan and not override(cfg.model_type).pp_plan:
        _check_convention(model)
    return plan_of(
        cfg.model_type,
        base_prefix(model),
        cfg.base_model_tp_plan,
        cfg.base_model_pp_plan,
        head,
        getattr(cfg, "base_model_ep_plan", None),
    )


def base_prefix(model: Any) -> str:
    """The causal LM's attribute holding the base model: its class's `base_model_prefix`, or the
    model type's OVERRIDES `prefix` where that names no attribute (Llama4ForCausalLM says
    `language_model`, its composite parent's name, and holds `model`)."""
    return override(model.config.model_type).prefix or model.base_model_prefix


def _check_convention(model: Any) -> None:
    """A model without a pp plan is staged by transformers' convention (`PP_CONVENTION`) only
    where its base model is exactly that: those children, a ModuleList of layers, and nothing
    else but its rotary module, which the stages rebuild. A base model with other modules (a
    second embedding, a norm before the layers) needs an OVERRIDES entry: its forward is not
    the convention's."""
    base = getattr(model, base_prefix(model))
    children = dict(base.named_children())
    missing = [n for n in PP_CONVENTION if n not in children]
    other = [n for n, m in children.items() if n not in PP_CONVENTION and "Rotary" not in type(m).__name__]
    if missing or other or type(children["layers"]).__name__ != "ModuleList":
        raise UnsupportedFeatures(
            f"{type(model).__name__}: no base_model_pp_plan, and its {base_prefix(model)} is not "
            f"{' -> '.join(PP_CONVENTION)} (missing: {', '.join(missing) or '-'}; other modules: "
            f"{', '.join(other) or '-'}): its stage pieces need a pp_plan entry in backends/hf_plan.py OVERRIDES"
        )


def checkpoint_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of what a checkpoint of `model` holds: its parameters (a tied one once)
    and its persistent buffers."""
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                out.setdefault(f"{mod_name}.{b_name}" if mod_name else b_name, tuple(b.shape))
    return out


def checkpoint_names(
    model: Any, shapes: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """({module tensor name: its name in a checkpoint}, {stacked experts tensor: its
    per-expert names}) — what `save_pretrained` writes, by transformers' own conversion
    mapping run in the saving direction (GPT-NeoX's `lm_head` is saved as `embed_out`;
    experts one tensor each: backends/hf_experts.py). A tensor any other converter would
    rewrite is refused."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        apply_converters,
        apply_renamings,
    )

    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    saving = [c.reverse_transform() for c in conversions[::-1]]
    renamings = [c for c in saving if isinstance(c, WeightRenaming)]
    converters = [c for c in saving if isinstance(c, WeightConverter)]
    experts = stacked(conversions, dict(shapes))
    converted = [n for n in shapes if n not in experts and apply_converters(n, converters)[1] is not None]
    if converted:
        raise UnsupportedFeatures(
            f"{type(model).__name__}: transformers converts {', '.join(converted[:4])} between the checkpoint and "
            "the model (not a rename), which the hf backend does not do yet"
        )
    saved = {n: apply_renamings(n, renamings) for n in shapes if n not in experts}
    return saved, {n: tuple(apply_renamings(h, renamings) for h in hs) for n, hs in experts.items()}


@dataclass(frozen=True)
class Meta:
    """What the meta-device model says about `spec`: its plan and every checkpoint tensor
    (shape, TP kind, name in a checkpoint)."""

    plan: Plan
    shapes: dict[str, tuple[int, ...]]
    kinds: dict[str, str]
    saved_as: dict[str, str]
    experts: dict[str, tuple[str, ...]]  # a stacked experts tensor -> its per-expert checkpoint tensors

    def hf_template(self, name: str, saved: str | None = None) -> str:
        """The checkpoint name of module tensor `name` (or `saved`, one of its checkpoint
        tensors) with `{layer}` where its layer index is (the concrete name when a rename
        moved the index)."""
        saved = self.saved_as[name] if saved is None else saved
        i = self.plan.layer_index(name)
        if i is None:
            return saved
        mine = f"{self.plan.layers}.{i}."
        return saved.replace(mine, f"{self.plan.layers}.{{layer}}.", 1) if saved.startswith(mine) else saved

    def numel(self, name: str) -> int:
        n = 1
        for d in self.shapes[name]:
            n *= d
        return n


@lru_cache(maxsize=16)
def meta(spec: BridgeSpec) -> Meta:
    """The model built on the meta device (no memory), read once per description."""
    # torch and transformers imported here: the core imports third-party packages only inside functions
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(transformers_config(spec))
    plan = model_plan(model)
    shapes = checkpoint_shapes(model)
    kinds = tensor_kinds(plan, shapes, spec.num_attention_heads, spec.num_query_groups, spec.head_dim)
    return Meta(plan, shapes, kinds, *checkpoint_names(model, shapes))


def _problems(hf: Mapping[str, Any], cfg: Any) -> list[str]:
    mt = cfg.model_type
    out = plan_problems(mt, cfg.base_model_tp_plan, cfg.base_model_pp_plan)
    kinds = list(getattr(cfg, "layer_types", None) or ())
    for kind in dict.fromkeys(kinds):
        if kind not in LAYER_KINDS:
            where = [i for i, k in enumerate(kinds) if k == kind]
            why = UNBUILT_KINDS.get(kind, f"the hf backend builds {LAYER_KINDS}")
            out.append(f"layer kind {kind!r} (layers {', '.join(map(str, where[:6]))}): {why}")
    out += forward_refusals(mt, hf)
    out += unbuilt_refusals(declared(cfg))
    return out


class HFBackend(Backend):
    name = "hf"

    def handles(self, hf: Mapping[str, Any]) -> bool:
        return causal_lm_class_name(str(hf.get("model_type", ""))) is not None

    def describe(self, hf: Mapping[str, Any], *, make_vocab_size_divisible_by: int) -> BridgeSpec:
        mt = str(hf.get("model_type", ""))
        arch = causal_lm_class_name(mt)
        if arch is None:
            raise UnsupportedFeatures(f"model_type {mt!r}: transformers has no causal-LM class for it")
        try:
            cfg = config_object(hf)
        except (TypeError, ValueError) as e:
            raise UnsupportedFeatures(f"{arch}: transformers refuses this config.json ({e})") from None
        problems = _problems(hf, cfg)
        if problems:
            raise UnsupportedFeatures(
                f"{arch} cannot run on the hf backend yet:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        base = base_fields(declared(cfg))
        missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") if not base.get(k)]
        if missing:
            raise UnsupportedFeatures(f"{arch}: config.json lacks {', '.join(missing)}")
        heads = int(base["num_attention_heads"])
        f: dict[str, Any] = {k: base[k] for k in ("num_layers", "hidden_size", "vocab_size")}
        f.update(
            family=mt,
            architecture=arch,
            ffn_hidden_size=int(base.get("ffn_hidden_size") or 4 * base["hidden_size"]),
            num_attention_heads=heads,
            num_query_groups=int(base.get("num_query_groups") or heads),
            head_dim=int(base.get("head_dim") or base["hidden_size"] // heads),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
            initializer_range=float(getattr(cfg, "initializer_range", 0.02) or 0.02),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            backend=self.name,
            hf_json=json.dumps(dict(hf), sort_keys=True),
            name=hf.get("_name_or_path") or mt,
        )
        f.update(expert_fields(cfg))
        for k in ("max_position_embeddings", "norm_epsilon", "rotary_base"):
            if base.get(k) is not None:
                f[k] = base[k]
        return BridgeSpec(**f)

    def describe_fields(self, fields: Mapping[str, Any]) -> BridgeSpec:
        raise UserError(
            "model.backend=hf builds transformers' model class from a config.json: set model.hf_path=DIR "
            "(the recipe's model fields describe native families only)"
        )

    def table(self, spec: BridgeSpec) -> tuple[Row, ...]:
        """One row per checkpoint tensor (layer index as `{layer}`): the chunk's name (the
        module's) <- the checkpoint's (`checkpoint_names`); a tied LM head reads the embedding
        (and is not written back)."""
        m = meta(spec)
        rows: dict[str, Row] = {}
        for name, kind in m.kinds.items():
            t = m.plan.template(name)
            if name in m.experts:
                pieces = m.experts[name]
                n = m.shapes[name][0]
                stacked = StackedExperts(n, len(pieces) // n, EXPERT_TP_SPLITS.get(m.plan.style(name) or ""))
                rows.setdefault(t, Row(t, [m.hf_template(name, h) for h in pieces], stacked))
                continue
            style = m.plan.style(name) or ""
            if style in EXPERT_TP_SPLITS and m.plan.style(name.rpartition(".")[0]) == MOE_TP:  # stacked in the file too
                whole = WholeStackedExperts(EXPERT_TP_SPLITS[style], EXPERT_TP_PACKS[style])
                rows.setdefault(t, Row(t, m.hf_template(name), whole))
                continue
            transform = TRANSFORMS[kind] if m.shapes[name] else SCALAR_T  # a 0-dim tensor has no rows to split
            rows.setdefault(t, Row(t, m.hf_template(name) if t != name else m.saved_as[name], transform))
        head, embed = f"{m.plan.head}.weight", f"{m.plan.embed}.weight"
        if spec.tie_word_embeddings and head not in m.shapes:
            rows[head] = Row(head, m.saved_as[embed], VOCAB_T, export=False)
        return tuple(rows.values())

    def count(self, spec: BridgeSpec) -> ParamCount:
        m = meta(spec)
        total = sum(m.numel(n) for n in m.shapes)
        embedding = sum(m.numel(n) for n, k in m.kinds.items() if k == VOCAB)
        per_layer: dict[int, int] = {}
        for n in m.shapes:
            i = m.plan.layer_index(n)
            if i is not None:
                per_layer[i] = per_layer.get(i, 0) + m.numel(n)
        return ParamCount(
            total=total,
            active=total,
            embedding=embedding,
            per_layer=max(per_layer.values(), default=0),
            padded_vocab=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, 1),
        )

    def hf_config(self, spec: BridgeSpec) -> dict[str, Any]:
        return dict(json.loads(spec.hf_json))

    def layout_limits(self, spec: BridgeSpec, layout: Any) -> list[tuple[str, str]]:
        out = []
        if layout.cp > 1:
            out += cp_refusals(self.hf_config(spec).get("layer_types"), layout.cp)
        if layout.sequence_parallel and layout.tp > 1:
            kinds = json.loads(spec.hf_json).get("layer_types") or ()
            out += [(why, "set parallel.sequence_parallel=false") for why in sp_refusals(meta(spec).plan, kinds)]
        plan = meta(spec).plan if spec.is_moe else None
        out += expert_limits(spec, layout, plan.ep if plan else (), plan.tp if plan else ())
        out += layer_limits(self.hf_config(spec), layout)
        if layout.tp > 1 and spec.num_query_groups % layout.tp:
            out.append(
                (
                    f"the hf backend gives each TP rank whole KV heads: {spec.num_query_groups} KV heads do not "
                    f"split over tp={layout.tp}",
                    "choose tp dividing the KV heads",
                )
            )
        return out

    def run_limits(self, spec: BridgeSpec, run: Any) -> list[tuple[str, str]]:
        """Training runs: pretraining (megatron DDP / distributed optimizer at tp·pp·vpp·dp,
        DeepSpeed ZeRO at dp·tp), checkpoints, resume, the HF export and LoRA on the planned
        linears (peft module names, HF PEFT adapter export), SFT with padded samples (a loss
        mask, causal attention: the pads come after the conversation), at cp as well, and MoE with
        transformers' load-balancing loss where its config switches it on (backends/hf_aux.py).
        Not yet: the rest (what sp does not cover is refused by `layout_limits`)."""
        out = aux_limits(transformers_config(spec), run.parallel.pp) if spec.is_moe else []
        if run.data.kind == "sft" and getattr(run.data, "packing", False):
            out.append(  # the chunk would attend across documents: it has no block-diagonal mask yet
                (
                    "packed SFT samples (per-document positions, block-diagonal attention) are not implemented "
                    "for the hf backend yet",
                    "set data.packing=false (one conversation per padded sample), or use a model with a native family",
                )
            )
        if run.peft.method == "lora" and run.parallel.sequence_parallel and run.parallel.tp > 1:
            out.append(  # the adapters' SP regions assume megatron's gather inside the linear, not at its module
                (
                    "LoRA with sequence parallelism is not verified for the hf backend yet (its column linears "
                    "take an input gathered at their module's entry)",
                    "set parallel.sequence_parallel=false",
                )
            )
        if run.train.recompute != "none":
            out.append(
                (
                    f"train.recompute={run.train.recompute}: activation recomputation is not implemented for the "
                    "hf backend yet",
                    "set train.recompute=none",
                )
            )
        return out

    def convert_limits(self, spec: BridgeSpec) -> list[tuple[str, str]]:
        return [
            (
                f"{spec.architecture} is an hf-backend model, whose megatron checkpoints `mbr convert` does not "
                "write yet",
                "load the HF directory itself (model.hf_path=DIR): the hf backend reads its shards rank-locally",
            )
        ]


__all__ = [
    "HFBackend",
    "Meta",
    "checkpoint_names",
    "checkpoint_shapes",
    "base_prefix",
    "config_object",
    "meta",
    "model_plan",
    "runs_on",
    "transformers_config",
]
