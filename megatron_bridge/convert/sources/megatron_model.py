"""What model a Megatron-written checkpoint holds, checked against the description the user gives.

The description comes from `model.hf_path` (its config.json): it says what the export's
config.json is and how each megatron tensor maps to HF. The checkpoint says what it is too —
Megatron-LM's `args` (in `common.pt` or every rank file), Megatron-Bridge's `run_config.yaml`
and NeMo's `context/model.yaml` (megatron-core's TransformerConfig fields) — and each value
it states is compared with the description's (`FACTS`): a mismatch is one error naming both,
before a byte of weights is read. The stored tensor shapes are compared after that, where the
source opens (`megatron_source`), so a value no file states is still caught by its shape.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.convert.sources.megatron import MegatronDir
from megatron_bridge.errors import UserError


@dataclass(frozen=True)
class Fact:
    """One property of the model as the description and as a checkpoint's own record give it."""

    label: str  # as messages name it
    spec: Callable[[BridgeSpec], Any]
    args: Callable[[Mapping[str, Any]], Any]  # Megatron-LM's `args` (vars); KeyError: not recorded
    config: Callable[[Mapping[str, Any]], Any]  # a TransformerConfig's fields (Megatron-Bridge, NeMo)
    applies: Callable[[BridgeSpec], bool] = lambda s: True


def _heads(a: Mapping[str, Any]) -> int:
    return a["num_query_groups"] if a.get("group_query_attention") else a["num_attention_heads"]


def _kv(a: Mapping[str, Any]) -> int:
    return a.get("kv_channels") or a["hidden_size"] // a["num_attention_heads"]


def _groups(c: Mapping[str, Any]) -> int:
    return c.get("num_query_groups") or c["num_attention_heads"]


def _has_dense(s: BridgeSpec) -> bool:
    return not s.is_moe or 0 in s.moe_layer_pattern


def _moe(s: BridgeSpec) -> bool:
    return s.is_moe


_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(s: BridgeSpec) -> Any:
    """The rotary scaling as Megatron-LM can state it: none, or Llama 3.1's (`--use-rope-scaling`)."""
    if s.rope_type == "default":
        return "default"
    params = dict(s.rope_params)
    return (s.rope_type, *(float(params.get(k, 0.0)) for k in _LLAMA3))


def _rope_recorded(use: Any, factor: Any) -> Any:
    # megatron-core's `_apply_scaling`: low 1, high 4 and 8192 original positions are fixed
    return ("llama3", float(factor or 8.0), 1.0, 4.0, 8192.0) if use else "default"


def _silu_glu(s: BridgeSpec) -> bool:
    return s.gated_linear_unit and s.activation == "silu"


def _plain(
    label: str, attr: str, arg: str, field: str | None = None, applies: Callable[[BridgeSpec], bool] = lambda s: True
) -> Fact:
    """A fact the description holds as `attr` and the records as `arg` (Megatron-LM's args) and
    `field` (a TransformerConfig's; the same name unless given)."""
    return Fact(label, attrgetter(attr), itemgetter(arg), itemgetter(field or arg), applies)


FACTS: tuple[Fact, ...] = (
    _plain("num_layers", "num_layers", "num_layers"),
    _plain("hidden_size", "hidden_size", "hidden_size"),
    _plain("attention heads", "num_attention_heads", "num_attention_heads"),
    Fact("query groups", lambda s: s.num_query_groups, _heads, _groups),
    Fact("head dim (kv_channels)", lambda s: s.head_dim, _kv, lambda c: c.get("kv_channels") or _kv(c)),
    _plain("ffn hidden size", "ffn_hidden_size", "ffn_hidden_size", applies=_has_dense),
    Fact(
        "rotary base",
        lambda s: float(s.rotary_base),
        lambda a: float(a["rotary_base"]),
        lambda c: float(c["rotary_base"]),
    ),
    Fact(
        "tied embeddings",
        lambda s: s.tie_word_embeddings,
        lambda a: not a["untie_embeddings_and_output_weights"],
        lambda c: c["share_embeddings_and_output_weights"],
    ),
    _plain("normalization", "normalization", "normalization"),
    _plain("norm epsilon", "norm_epsilon", "norm_epsilon", "layernorm_epsilon"),
    Fact("SwiGLU", _silu_glu, lambda a: bool(a["swiglu"]), lambda c: bool(c["gated_linear_unit"])),
    Fact(
        "qkv bias",
        lambda s: s.add_qkv_bias,
        lambda a: bool(a.get("add_qkv_bias") or a["add_bias_linear"]),
        lambda c: bool(c.get("add_qkv_bias") or c["add_bias_linear"]),
    ),
    Fact(
        "qk layernorm", lambda s: s.qk_layernorm, lambda a: bool(a["qk_layernorm"]), lambda c: bool(c["qk_layernorm"])
    ),
    _plain("experts", "num_moe_experts", "num_experts", "num_moe_experts"),
    Fact(
        "expert ffn size",
        lambda s: s.moe_ffn_hidden_size,
        lambda a: a["moe_ffn_hidden_size"] or a["ffn_hidden_size"],
        lambda c: c["moe_ffn_hidden_size"] or c["ffn_hidden_size"],
        _moe,
    ),
    _plain("router top-k", "moe_router_topk", "moe_router_topk", applies=_moe),
    _plain(
        "shared expert size",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        applies=_moe,
    ),
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, int | float) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def check_facts(spec: BridgeSpec, record: Mapping[str, Any], kind: str, where: str, described_by: str) -> int:
    """Each fact `record` states (`kind`: "args" for Megatron-LM's, "config" for a
    TransformerConfig's) must be the description's; UserError naming every mismatch with both
    values. Returns how many facts were compared (0: the record states none)."""
    bad, compared = [], 0
    for f in FACTS:
        if not f.applies(spec):
            continue
        try:
            theirs = (f.args if kind == "args" else f.config)(record)
        except (KeyError, TypeError, ZeroDivisionError):
            continue  # not recorded (an older Megatron-LM, a field this writer leaves out)
        if theirs is None and f.label not in ("experts", "shared expert size"):
            continue
        compared += 1
        ours = f.spec(spec)
        if not _same(ours, theirs):
            bad.append(f"{f.label}: {described_by} says {ours!r}, the checkpoint {theirs!r}")
    if bad:
        raise UserError(
            f"{where} holds another model than {described_by} describes; point model.hf_path at the HF "
            "config of the model this checkpoint trained (its config.json, with the tokenizer files beside it):\n"
            + "\n".join(f"  - {b}" for b in bad)
        )
    return compared


@dataclass(frozen=True)
class RunRecord:
    """What a checkpoint's run recorded about itself: its `records` ("args" | "config", the
    fields) for `check_facts`, and the parallel degrees and vocabulary divisor it trained with."""

    records: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    degrees: Mapping[str, Any] = field(default_factory=dict)  # Megatron-LM's args names
    divisor: int | None = None  # make_vocab_size_divisible_by, where recorded
    ranks: tuple[tuple[int, int, int], ...] = ()  # per-rank files' (tp, pp-or-ep, ep) from their names

    @property
    def tp(self) -> int:
        return int(self.degrees.get("tensor_model_parallel_size") or 1)

    def layout(self, spec: BridgeSpec | None) -> Layout:
        """The layout the checkpoint was written at (per-rank files: which rank holds what)."""
        g = self.degrees
        if not g and self.ranks:  # no record: what the rank directories' names say
            tp = 1 + max(r[0] for r in self.ranks)
            return Layout(tp=tp, pp=1 + max(r[1] for r in self.ranks), ep=1 + max(r[2] for r in self.ranks))
        pp = int(g.get("pipeline_model_parallel_size") or 1)
        vpp = g.get("virtual_pipeline_model_parallel_size")
        per_chunk = g.get("num_layers_per_virtual_pipeline_stage")
        if vpp is None and per_chunk and spec is not None:
            vpp = spec.num_layers // (pp * int(per_chunk))
        return Layout(
            tp=self.tp,
            pp=pp,
            vpp=int(vpp) if vpp else None,
            ep=int(g.get("expert_model_parallel_size") or 1),
            etp=g.get("expert_tensor_parallel_size") or None,  # type: ignore[arg-type]  # None = tp
            layers_first_stage=g.get("decoder_first_pipeline_num_layers"),
            layers_last_stage=g.get("decoder_last_pipeline_num_layers"),
        )


_DEGREES = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers_per_virtual_pipeline_stage",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
)


def _yaml(path: Path) -> dict[str, Any]:
    """A config file as plain data (`yaml.safe_load`: no tags that build objects). One that does
    not parse so is left out with a note: the stored shapes are still checked."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        print(
            f"note: {path} is not plain YAML ({str(e).splitlines()[0]}): the facts it states are not checked",
            flush=True,
        )
        return {}
    return data if isinstance(data, dict) else {}


def _model_section(path: Path) -> dict[str, Any]:
    """The TransformerConfig fields of Megatron-Bridge's run_config.yaml (`model:`) or NeMo's
    context/model.yaml (`config:`)."""
    data = _yaml(path)
    for key in ("model", "config"):
        if isinstance(data.get(key), dict):
            return data[key]
    return data


def run_record(md: MegatronDir, state: Mapping[str, Any]) -> RunRecord:
    """`md`'s own record of its run: `args` (a Namespace in `common.pt` / rank 0's file) and
    its config files (`MegatronDir.configs`)."""
    records: list[tuple[str, Mapping[str, Any]]] = []
    degrees: dict[str, Any] = {}
    divisor = None
    args = state.get("args")
    if isinstance(args, argparse.Namespace):
        a = vars(args)
        records.append(("args", a))
        degrees.update({k: a[k] for k in _DEGREES if a.get(k) is not None})
        divisor = a.get("make_vocab_size_divisible_by")
    for path in md.configs:
        c = _model_section(path)
        records.append(("config", c))
        for k in _DEGREES:
            if c.get(k) is not None:
                degrees.setdefault(k, c[k])
        divisor = divisor or c.get("make_vocab_size_divisible_by")
    return RunRecord(tuple(records), degrees, int(divisor) if divisor else None, tuple(r for r, _ in md.ranks))


__all__ = ["FACTS", "Fact", "RunRecord", "check_facts", "run_record"]
