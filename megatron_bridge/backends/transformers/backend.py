"""`transformers`: transformers' own modeling code under megatron's parallel layers and schedules.

For an architecture with no native family: the causal-LM class transformers has for the
config's `model_type` is built on the meta device, each pipeline stage keeps its pieces of the
model (`plan.Plan`, from transformers' `base_model_pp_plan`), and every linear the
`base_model_tp_plan` names becomes megatron's column/row-parallel linear holding its shard
(runtime/transformers/); MoE experts modules are split over EP (backends/transformers/experts.py). This slice covers
decoder-only models at TP and PP, and MoE at EP·PP without TP (docs/bridge.md, "The hf
backend"); what it cannot do yet is refused here, one line each.

The description keeps the common dimensions (`bridge.hf_config.HF_KEYS`, read from
transformers' config object, so its defaults count) for the rules and the planner, and the
config.json itself (`BridgeSpec.hf_json`) for the builder. The weight table and the parameter
count come from the meta-device model: exact, with transformers' own names.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from megatron_bridge.backends.base import Backend, Shape
from megatron_bridge.backends.transformers import adapters, checkpoint
from megatron_bridge.backends.transformers.aux import aux_limits
from megatron_bridge.backends.transformers.experts import (
    JoinedStackedExperts,
    StackedExperts,
    TransposedExperts,
    WholeStackedExperts,
    expert_fields,
    expert_limits,
    expert_split,
    expert_width,
)
from megatron_bridge.backends.transformers.fused import Concatenated, ConcatenatedColumns
from megatron_bridge.backends.transformers.meta import (  # re-exported: callers name the backend's module
    Meta,
    causal_lm_class_name,
    class_name,
    config_object,
    declared,
    meta,
    model_plan,
    transformers_config,
)
from megatron_bridge.backends.transformers.plan import (
    COLUMN,
    GRAD_ALLREDUCE,
    HEAD,
    LAYER_KINDS,
    MOE_TP,
    REPLICATED,
    ROW,
    UNBUILT_KINDS,
    VOCAB,
    cp_refusals,
    forward_refusals,
    layer_limits,
    override,
    packing_refusals,
    plan_problems,
    sp_refusals,
    unbuilt_refusals,
)
from megatron_bridge.backends.transformers.shards import adapter_params, shards
from megatron_bridge.backends.transformers.split import ChunkPiece
from megatron_bridge.backends.transformers.vision import (
    FREEZE_GROUPS,
    after_layer_count,
    freeze_group,
    text_config_of,
    vision_limits,
)
from megatron_bridge.backends.transformers.vlm_describe import forward_source, text_json, tied, with_vision
from megatron_bridge.bridge.hf_config import UnsupportedFeatures, base_fields
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.mapping import COLUMN as COLUMN_T
from megatron_bridge.bridge.mapping import REPLICATED as REPLICATED_T
from megatron_bridge.bridge.mapping import ROW as ROW_T
from megatron_bridge.bridge.mapping import SCALAR as SCALAR_T
from megatron_bridge.bridge.mapping import VOCAB as VOCAB_T
from megatron_bridge.bridge.mapping import WHOLE_LINEAR as WHOLE_LINEAR_T
from megatron_bridge.bridge.mapping import Transform
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping as Row
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.dims import padded_vocab_size
from megatron_bridge.plan.params import ParamCount
from megatron_bridge.plan.shards import ModelShards

AS_HELD = "#as-held"  # the key of a tensor's second row (see `table`)
TRANSFORMS = {
    VOCAB: VOCAB_T,
    COLUMN: COLUMN_T,
    HEAD: COLUMN_T,
    ROW: ROW_T,
    GRAD_ALLREDUCE: REPLICATED_T,
    REPLICATED: REPLICATED_T,
}


def _problems(hf: Mapping[str, Any], cfg: Any, vlm: tuple[str, str] | None = None) -> list[str]:
    """What the language model's config (`hf`: its config.json part) switches on that this backend
    cannot run, one line each (`vlm`: a VLM's model type and its class's forward source, which
    holds the LM head's arithmetic)."""
    mt = cfg.model_type
    out = plan_problems(mt, cfg.base_model_tp_plan, cfg.base_model_pp_plan)
    kinds = list(getattr(cfg, "layer_types", None) or ())
    own = {k for k, _ in override(mt).kind_masks}  # masked by the model's own function (Override.kind_masks)
    for kind in dict.fromkeys(kinds):
        if kind not in LAYER_KINDS and kind not in own:
            where = [i for i, k in enumerate(kinds) if k == kind]
            why = UNBUILT_KINDS.get(kind, f"the transformers backend builds {LAYER_KINDS}")
            out.append(f"layer kind {kind!r} (layers {', '.join(map(str, where[:6]))}): {why}")
    out += forward_refusals(mt, hf, *(vlm or ()))
    out += unbuilt_refusals(declared(cfg))
    return out


def _latent_attention(cfg: Any) -> dict[str, Any]:
    """Multi-head latent attention's sizes (DeepSeek-V2/V3, MiniCPM3, ...), where the config has
    them as one value for every layer: what the planner's activation memory reads."""
    kv = _uniform(cfg, "kv_lora_rank")
    if not isinstance(kv, int) or kv <= 0:
        return {}
    out: dict[str, Any] = {
        "multi_latent_attention": True,
        "kv_lora_rank": kv,
        "q_lora_rank": _uniform(cfg, "q_lora_rank"),
    }
    for ours, theirs in (
        ("qk_head_dim", "qk_nope_head_dim"),
        ("qk_pos_emb_head_dim", "qk_rope_head_dim"),
        ("v_head_dim", "v_head_dim"),
    ):
        if isinstance(value := _uniform(cfg, theirs), int):
            out[ours] = value
    return out


def _uniform(cfg: Any, key: str) -> Any:
    """`cfg.key`, or None where the config has no such key or holds it per layer (transformers'
    heterogeneous configs refuse a global read of a per-layer attribute)."""
    try:
        return getattr(cfg, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


class TransformersBackend(Backend):
    name = "transformers"
    from_fields = False  # a model of transformers' classes is its config.json

    def handles(self, hf: Mapping[str, Any]) -> bool:
        return class_name(hf) is not None

    def describe(self, hf: Mapping[str, Any], *, make_vocab_size_divisible_by: int) -> BridgeSpec:
        """A causal LM, or a VLM (backends/transformers/vision.py) described by its language model:
        the dimensions, plans and forward refusals are its text config's; `family` is the
        language model's type, which keys the override table; `architecture` the class built."""
        mt = str(hf.get("model_type", ""))
        arch = class_name(hf)
        if arch is None:
            raise UnsupportedFeatures(
                f"model_type {mt!r}: transformers has no causal-LM or image-text-to-text class for it"
            )
        try:
            full = config_object(hf)
        except (TypeError, ValueError) as e:
            raise UnsupportedFeatures(f"{arch}: transformers refuses this config.json ({e})") from None
        cfg = text_config_of(full)
        vlm = (full.model_type, forward_source(arch)) if cfg is not full else None
        problems = _problems(text_json(hf, full), cfg, vlm)
        if problems:
            raise UnsupportedFeatures(
                f"{arch} cannot run on the transformers backend yet:\n" + "\n".join(f"  - {p}" for p in problems)
            )
        base = base_fields(declared(cfg))
        missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size") if not base.get(k)]
        if missing:
            raise UnsupportedFeatures(f"{arch}: config.json lacks {', '.join(missing)}")
        heads = int(base["num_attention_heads"])
        f: dict[str, Any] = {k: base[k] for k in ("num_layers", "hidden_size", "vocab_size")}
        f.update(
            family=cfg.model_type,
            architecture=arch,
            ffn_hidden_size=int(base.get("ffn_hidden_size") or 4 * base["hidden_size"]),
            num_attention_heads=heads,
            num_query_groups=int(base.get("num_query_groups") or heads),
            head_dim=int(base.get("head_dim") or base["hidden_size"] // heads),
            tie_word_embeddings=tied(full, cfg),
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
        if f.get("num_moe_experts"):  # the planner's expert widths
            for k in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
                if base.get(k):
                    f[k] = expert_width(base[k])
        f.update(_latent_attention(cfg))
        return with_vision(BridgeSpec.make(**f), full)

    def describe_fields(self, fields: Mapping[str, Any]) -> BridgeSpec:
        raise UserError(
            "model.backend=transformers builds transformers' model class from a config.json: set model.hf_path=DIR "
            "(the recipe's model fields describe native families only)"
        )

    def table(self, spec: BridgeSpec) -> tuple[Row, ...]:
        """One row per checkpoint tensor (layer index as `{layer}`): the chunk's name (the
        module's) <- the checkpoint's (`checkpoint_names`); a tied LM head reads the embedding
        (and is not written back). A tensor transformers converts on load (per-expert tensors
        stacked, pieces joined) has a second row reading it as the model holds it, under its
        module name: transformers loads a checkpoint in either form, and so does this; the first
        row (what `save_pretrained` writes) is the one an export from a live model writes."""
        m = meta(spec)
        rows: dict[str, Row] = {}
        template = {name: m.plan.template(name) for name in m.kinds}
        split_of: dict[str, set[str]] = {}  # a template's kinds: split one way in some layers, another in others
        for name, kind in m.kinds.items():
            split_of.setdefault(template[name], set()).add(kind)
        for name, kind in m.kinds.items():
            t = template[name]
            t = name if len(split_of[t]) > 1 else t  # one row per layer (overrides.Override.kind_tp_plan)
            if name in m.experts:
                pieces = m.experts[name]
                n = m.shapes[name][0]
                split = expert_split(name, m.plan.style(name))
                stacked = StackedExperts(n, len(pieces) // n, split.split if split else None)
                rows.setdefault(t, Row(t, [m.hf_template(name, h) for h in pieces], stacked))
                # a checkpoint may hold it as the model does (transformers loads either): stacked
                rows.setdefault(t + AS_HELD, Row(t, t, WholeStackedExperts(*split) if split else REPLICATED_T))
                continue
            split = expert_split(name, m.plan.style(name))
            moe = WholeStackedExperts(*split) if split and m.plan.style(name.rpartition(".")[0]) == MOE_TP else None
            if name in m.fused:  # its pieces concatenated (backends/transformers/fused.py); experts as moe_tp splits
                pieces, dim = m.fused[name]
                joined: Transform = (ConcatenatedColumns if kind == ROW else Concatenated)(len(pieces), dim)
                joined = JoinedStackedExperts(len(pieces), dim, moe) if moe else joined
                rows.setdefault(t, Row(t, [m.hf_template(name, h) for h in pieces], joined))
                rows.setdefault(t + AS_HELD, Row(t, t, moe or TRANSFORMS[kind]))  # or already joined, as held
                continue
            if name in m.split:  # a run of rows of one checkpoint tensor (backends/transformers/split.py)
                c = m.split[name]
                piece = ChunkPiece(c.at, c.rows, c.nth, c.pieces, c.heads, linear=name in m.whole_linears)
                rows.setdefault(t, Row(t, m.hf_template(name), piece))
                rows.setdefault(t + AS_HELD, Row(t, t, TRANSFORMS[kind]))  # or as the model holds it
                continue
            if name in m.transposed:  # stacked in the file with two dims swapped
                d0, d1, either = m.transposed[name]
                swapped = TransposedExperts(moe or REPLICATED_T, (d0, d1), m.shapes[name] if either else None)
                rows.setdefault(t, Row(t, m.hf_template(name), swapped))
                continue
            if moe:  # stacked in the file too
                rows.setdefault(t, Row(t, m.hf_template(name), moe))
                continue
            transform = TRANSFORMS[kind] if m.shapes[name] else SCALAR_T  # a 0-dim tensor has no rows to split
            if name in m.whole_linears:  # a vision tower's linear: whole, and LoRA may adapt it
                transform = WHOLE_LINEAR_T
            rows.setdefault(t, Row(t, m.hf_template(name) if t != name else m.saved_as[name], transform))
        head, embed = f"{m.plan.head}.weight", f"{m.plan.embed}.weight"
        if spec.tie_word_embeddings and head not in m.shapes:
            rows[head] = Row(head, m.saved_as[embed], VOCAB_T, export=False)
        return tuple(rows.values())

    def count(self, spec: BridgeSpec) -> ParamCount:
        """The meta model's parameters (persistent buffers are not), exact; `active` with each
        MoE layer's top-k experts in place of all of them."""
        m, s = meta(spec), shards(spec)
        active = s.total - sum(s.kinds[k].total - s.kinds[k].active(spec.moe_router_topk) for k in s.layer_kind)
        return ParamCount(
            total=s.total,
            active=active,
            embedding=sum(m.numel(n) for n in m.parameters if m.kinds[n] == VOCAB),
            per_layer=max((k.total for k in s.kinds), default=0),
            padded_vocab=padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, 1),
            moe_layers=s.moe_layers(),
        )

    def shards(self, spec: BridgeSpec) -> ModelShards:
        return shards(spec)

    def adapter_params(
        self, spec: BridgeSpec, peft: Any, *, tp: int, etp: int, ep: int, layers: Sequence[int], first: bool
    ) -> tuple[float, float]:
        return adapter_params(spec, self.table(spec), peft, tp=tp, layers=layers, first=first)

    def hf_config(self, spec: BridgeSpec) -> dict[str, Any]:
        return dict(json.loads(spec.hf_json))

    def adapter_names(self, spec: BridgeSpec, row: Resolved | Row) -> list[str]:
        return adapters.adapter_names(row)

    def lora_refusals(self, spec: BridgeSpec, targets: Sequence[str]) -> list[str]:
        return adapters.lora_refusals(meta(spec), self.table(spec), targets)

    def freeze_groups(self, spec: BridgeSpec) -> tuple[str, ...]:
        return FREEZE_GROUPS if meta(spec).plan.vision else ()

    def group_of(self, spec: BridgeSpec, name: str) -> str:
        return freeze_group(meta(spec).plan, name)

    def adds_aux_loss(self, spec: BridgeSpec) -> bool:
        return True  # transformers' own modules give it (backends/transformers/aux.py)

    def layout_limits(self, spec: BridgeSpec, layout: Any) -> list[tuple[str, str]]:
        out = []
        full = transformers_config(spec)
        if layout.cp > 1:
            out += cp_refusals(list(meta(spec).layer_kinds), layout.cp)
        if layout.sequence_parallel and layout.tp > 1:
            out += [(why, "set parallel.sequence_parallel=false") for why in sp_refusals(meta(spec).plan)]
        plan = meta(spec).plan if spec.is_moe else None
        out += expert_limits(spec, layout, plan.ep if plan else (), plan.tp if plan else ())
        out += layer_limits(declared(text_config_of(full)), layout)  # with the class defaults (layer_types)
        out += vision_limits(layout, meta(spec).plan.vision, after_layer_count(full), spec.num_layers)
        if layout.tp > 1 and spec.num_query_groups % layout.tp:
            out.append(
                (
                    f"the transformers backend gives each TP rank whole KV heads: {spec.num_query_groups} KV heads do not "
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
        transformers' load-balancing loss where its config switches it on (backends/transformers/aux.py).
        Not yet: the rest (what sp does not cover is refused by `layout_limits`)."""
        out = aux_limits(text_config_of(transformers_config(spec)), run.parallel.pp) if spec.is_moe else []
        if run.data.kind == "sft" and getattr(run.data, "packing", False):
            m = meta(spec)
            out += [
                (f"packed SFT samples: {why}", "set data.packing=false (one conversation per padded sample)")
                for why in packing_refusals(m.layer_kinds, m.plan.image_positions)
            ]
        if run.peft.method == "lora" and run.parallel.sequence_parallel and run.parallel.tp > 1:
            out.append(  # the adapters' SP regions assume megatron's gather inside the linear, not at its module
                (
                    "LoRA with sequence parallelism is not verified for the transformers backend yet (its column linears "
                    "take an input gathered at their module's entry)",
                    "set parallel.sequence_parallel=false",
                )
            )
        if run.train.recompute == "selective":
            out.append(  # megatron's selective recompute re-runs its own attention core, which these layers do not use
                (
                    "train.recompute=selective: selective recomputation (megatron-core's attention core) is not "
                    "implemented for the transformers backend, whose layers are transformers' own code",
                    "set train.recompute=full (each decoder layer recomputed in backward) or train.recompute=none",
                )
            )
        return out

    # -- checkpoints: transformers' names (transformers/checkpoint.py) ------------------------------------------
    def expected(self, spec: BridgeSpec, padded_vocab: int) -> dict[str, Shape | None]:
        return checkpoint.expected(meta(spec), spec, padded_vocab)

    def owned(self, spec: BridgeSpec, row: Resolved, layout: Layout, coords: Coords, layers: range) -> str | None:
        where = stage_pieces(spec).get(row.megatron)
        if where is None:
            raise UserError(f"{row.megatron} is no tensor of the {spec.architecture} model")
        return checkpoint.owned(where, spec, row.megatron in meta(spec).shapes, row, layout, coords, layers)

    def ep_stacked(self, spec: BridgeSpec, row: Resolved) -> bool:
        return checkpoint.ep_stacked(meta(spec), spec, row)

    def integer_tensors(self, spec: BridgeSpec) -> frozenset[str]:
        return meta(spec).integers

    def dist_location(self, spec: BridgeSpec, name: str) -> DistLocation:
        return DistLocation(name)

    def rank_state(self, spec: BridgeSpec, entries: dict[str, tuple[int, object]], post_process: bool) -> dict:
        return checkpoint.rank_state(meta(spec), entries, post_process)

    def checkpoint_args(self, spec: BridgeSpec, layout: Layout, dtype: DType, ckpt_format: str) -> argparse.Namespace:
        return checkpoint.checkpoint_args(spec, layout, dtype, ckpt_format)


@lru_cache(maxsize=16)
def stage_pieces(spec: BridgeSpec) -> dict[str, str | int]:
    """Every tensor's stage piece (checkpoint.pieces), once per description."""
    m = meta(spec)
    return checkpoint.pieces(m, transformers_config(spec), list(checkpoint.expected(m, spec, 1)))


__all__ = [
    "TransformersBackend",
    "stage_pieces",
    "Meta",
    "causal_lm_class_name",
    "config_object",
    "meta",
    "model_plan",
    "transformers_config",
]
