"""LoRA targets in Hugging Face names, resolved through the bridge's weight tables.

A user names HF modules (`q_proj`, `gate_proj`, `w1`, or any dotted suffix such as
`self_attn.o_proj`, matched as HF PEFT matches `target_modules`). The family table already
says which megatron linear holds each HF linear and how (`FusedQKV` interleaves q, k, v per
query group; `FusedGateUp` stacks gate and up; `Row` / `Column` split one weight), so a
target is a table row plus the indices of its HF inputs that get an adapter; the placement
of each adapter's output rows inside the fused megatron output comes from the same
transform (runtime/lora_modules.py). Nothing here imports torch: `mbr check` and the rules
use it; the adapter files (HF PEFT's layout: written, checked, copied out of a training
checkpoint) are runtime/lora_export.py's.

The adapter's state in HF PEFT's own file layout (`adapter_model.safetensors`) is keyed
`base_model.model.<hf module>.lora_A.weight` / `.lora_B.weight`; `peft_key` makes those.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_bridge.bridge.mapping import Column, FusedGateUp, FusedQKV, Row
from megatron_bridge.bridge.registry import get_family
from megatron_bridge.bridge.table import Mapping
from megatron_bridge.errors import UserError

# Transforms of megatron linears LoRA can wrap: column-parallel (output rows split, maybe
# fused from several HF linears) and row-parallel (input columns split); and any transform that
# says it `adapts_whole` (a linear whole on every rank: its adapters too).
COLUMN_KINDS = (FusedQKV, FusedGateUp, Column)
ROW_KINDS = (Row,)
ADAPTER_CHILD = "lora"  # the adapter module's attribute name on the megatron linear
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_DIR = "adapter"  # a peft=lora checkpoint's copy of its adapter in HF PEFT format
PEFT_PREFIX = "base_model.model."


def is_adapter_param(name: str) -> bool:
    """Whether a megatron parameter name is an adapter's (the loader and the HF export skip
    them: they have no row in the family table)."""
    return f".{ADAPTER_CHILD}." in f".{name}"


def hf_module(hf_tensor: str) -> str:
    """`model.layers.{layer}.self_attn.q_proj.weight` -> `model.layers.{layer}.self_attn.q_proj`."""
    return hf_tensor.rsplit(".", 1)[0]


def matches(module: str, target: str) -> bool:
    """HF PEFT's rule for a `target_modules` entry: the whole name or a dotted suffix."""
    return module == target or module.endswith("." + target)


def is_linear_row(m: Mapping) -> bool:
    return m.megatron.endswith(".weight") and (
        isinstance(m.transform, COLUMN_KINDS + ROW_KINDS) or m.transform.adapts_whole
    )


@dataclass(frozen=True)
class Target:
    """One megatron linear that carries adapters: its table row and which HF inputs."""

    mapping: Mapping
    srcs: tuple[int, ...]

    @property
    def column(self) -> bool:
        return isinstance(self.mapping.transform, COLUMN_KINDS)

    @property
    def whole(self) -> bool:
        """A linear whole on every TP rank: A and B whole too, no communication."""
        return self.mapping.transform.adapts_whole


def _checkpoint_names(m: Mapping) -> Sequence[str]:
    return m.hf


def targetable(table: Sequence[Mapping], names: Callable[[Mapping], Sequence[str]] = _checkpoint_names) -> list[str]:
    """The short HF module names a family's table offers (for error messages)."""
    found = {hf_module(h).rsplit(".", 1)[-1] for m in table if is_linear_row(m) for h in names(m)}
    return sorted(found)


def resolve_targets(
    table: Sequence[Mapping],
    targets: Sequence[str],
    family: str,
    names: Callable[[Mapping], Sequence[str]] = _checkpoint_names,
) -> list[Target]:
    """The table rows `targets` hit; a target that hits nothing is a UserError naming the
    family's linears (so a typo or another family's name never silently trains nothing).
    `names(row)`: the tensor names of the modules PEFT would adapt for the row, one per HF
    input (`Backend.adapter_names`; the checkpoint's names for native families)."""
    out: list[Target] = []
    hit: set[str] = set()
    for m in table:
        if not is_linear_row(m):
            continue
        mods = [hf_module(h) for h in names(m)]
        srcs = tuple(i for i, h in enumerate(mods) if any(matches(h, t) for t in targets))
        hit.update(t for t in targets for h in mods if matches(h, t))
        if srcs:
            out.append(Target(m, srcs))
    missing = [t for t in targets if t not in hit]
    if missing or not targets:
        raise UserError(
            f"peft.target_modules={list(targets)}: {missing or 'an empty list'} "
            f"{'names no' if missing else 'has no'} linear module of the {family} family. Use its Hugging "
            f"Face module names: {', '.join(targetable(table, names))} (e.g. peft.target_modules=[q_proj,v_proj])."
        )
    return out


def peft_key(hf_tensor: str, which: str) -> str:
    """The adapter file key of `hf_tensor`'s module: which = "A" or "B"."""
    return f"{PEFT_PREFIX}{hf_module(hf_tensor)}.lora_{which}.weight"


def adapter_config(peft: Any, base: str | None) -> dict[str, Any]:
    """`adapter_config.json` as HF PEFT writes it for a plain LoRA on a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": peft.rank,
        "lora_alpha": peft.alpha,
        "lora_dropout": peft.dropout,
        "target_modules": sorted(peft.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def base_of(cfg: Any, spec: Any) -> str | None:
    """The base model an adapter run needs (a checkpoint refers to it instead of holding it):
    `train.init_from`, else the HF directory the model was described from."""
    return cfg.train.init_from or spec.source


def layer_adapter_params(m: Any, peft: Any, *, tp: int = 1, etp: int = 1) -> tuple[float, float]:
    """LoRA parameters of one transformer layer on one rank, (dense, per local expert), for
    the planner: column-parallel adapters keep A whole and split B's rows, row-parallel ones
    split A's columns and keep B whole (as `lora_modules` lays them out). The HF modules'
    shapes follow from the megatron linear holding them (q/k/v rows, fc1's gate/up, ...).
    MoE models count every layer as MoE (plan.params counts a dense-first layer as dense;
    the adapters of those few layers are approximated)."""
    h, a, d, r = m.hidden_size, m.num_attention_heads, m.head_dim, peft.rank
    g = m.num_query_groups or a  # a ModelConfig (None = MHA) or a BridgeSpec (the planner)
    f, moe = m.ffn_hidden_size, bool(m.num_moe_experts)
    dense = expert = 0.0
    for t in resolve_targets(get_family(m.family).table, list(peft.target_modules), m.family):
        name = t.mapping.megatron
        is_exp, shared = t.mapping.is_expert, ".shared_experts." in name
        if moe and not is_exp and not shared and ".mlp." in name:
            continue  # a dense MLP row of a MoE family
        width = (
            (m.moe_ffn_hidden_size or f) if is_exp else (m.moe_shared_expert_intermediate_size or f) if shared else f
        )
        outs, fan_in = {
            "linear_qkv": ([a * d, g * d, g * d], h),
            "linear_proj": ([h], a * d),
            "linear_fc1": ([width, width], h),
            "linear_fc2": ([h], width),
        }[name.split(".")[-2]]
        split = etp if is_exp else tp
        n = sum(r * fan_in + r * outs[i] / split if t.column else r * fan_in / split + r * outs[i] for i in t.srcs)
        if is_exp:
            expert += n
        else:
            dense += n
    return dense, expert


__all__ = [
    "Target",
    "is_adapter_param",
    "resolve_targets",
    "targetable",
    "peft_key",
    "adapter_config",
    "base_of",
    "layer_adapter_params",
    "ADAPTER_CONFIG",
    "ADAPTER_DIR",
    "ADAPTER_WEIGHTS",
]
