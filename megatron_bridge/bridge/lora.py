"""LoRA targets in Hugging Face names, resolved through the bridge's weight tables.

A user names HF modules (`q_proj`, `gate_proj`, `w1`, or any dotted suffix such as
`self_attn.o_proj`, matched as HF PEFT matches `target_modules`). The family table already
says which megatron linear holds each HF linear and how (`FusedQKV` interleaves q, k, v per
query group; `FusedGateUp` stacks gate and up; `Row` / `Column` split one weight), so a
target is a table row plus the indices of its HF inputs that get an adapter; the placement
of each adapter's output rows inside the fused megatron output comes from the same
transform (`lora_modules.py`). Nothing here imports torch: `mbr check` and the rules use it.

The adapter's state in HF PEFT's own file layout (`adapter_model.safetensors`) is keyed
`base_model.model.<hf module>.lora_A.weight` / `.lora_B.weight`; `peft_key` makes those.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_bridge.bridge.mapping import Column, FusedGateUp, FusedQKV, Row
from megatron_bridge.bridge.table import Mapping
from megatron_bridge.errors import UserError

# Transforms of megatron linears LoRA can wrap: column-parallel (output rows split, maybe
# fused from several HF linears) and row-parallel (input columns split).
COLUMN_KINDS = (FusedQKV, FusedGateUp, Column)
ROW_KINDS = (Row,)
ADAPTER_CHILD = "lora"  # the adapter module's attribute name on the megatron linear
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
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
    return m.megatron.endswith(".weight") and isinstance(m.transform, COLUMN_KINDS + ROW_KINDS)


@dataclass(frozen=True)
class Target:
    """One megatron linear that carries adapters: its table row and which HF inputs."""

    mapping: Mapping
    srcs: tuple[int, ...]

    @property
    def column(self) -> bool:
        return isinstance(self.mapping.transform, COLUMN_KINDS)


def targetable(table: Sequence[Mapping]) -> list[str]:
    """The short HF module names a family's table offers (for error messages)."""
    names = {hf_module(h).rsplit(".", 1)[-1] for m in table if is_linear_row(m) for h in m.hf}
    return sorted(names)


def resolve_targets(table: Sequence[Mapping], targets: Sequence[str], family: str) -> list[Target]:
    """The table rows `targets` hit; a target that hits nothing is a UserError naming the
    family's linears (so a typo or another family's name never silently trains nothing)."""
    out: list[Target] = []
    hit: set[str] = set()
    for m in table:
        if not is_linear_row(m):
            continue
        srcs = tuple(i for i, h in enumerate(m.hf) if any(matches(hf_module(h), t) for t in targets))
        hit.update(t for t in targets for h in m.hf if matches(hf_module(h), t))
        if srcs:
            out.append(Target(m, srcs))
    missing = [t for t in targets if t not in hit]
    if missing or not targets:
        raise UserError(
            f"peft.target_modules={list(targets)}: {missing or 'an empty list'} "
            f"{'names no' if missing else 'has no'} linear module of the {family} family. Use its Hugging "
            f"Face module names: {', '.join(targetable(table))} (e.g. peft.target_modules=[q_proj,v_proj])."
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


def check_adapter_dir(path: str | Path, base_dir: str | Path | None, peft: Any) -> dict[str, Any]:
    """An HF PEFT adapter `peft.init_from` may start from: a LoRA of this rank, whose every
    module exists in the base checkpoint with matching shapes. Returns its config."""
    from safetensors import safe_open

    p = Path(path)
    cfg_file, weights = p / ADAPTER_CONFIG, p / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise UserError(
            f"peft.init_from={path} is not an HF PEFT adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}). "
            "Point it at what `PeftModel.save_pretrained` or `export_adapter_to=DIR` wrote."
        )
    conf = json.loads(cfg_file.read_text())
    if conf.get("peft_type") != "LORA" or conf.get("r") != peft.rank or conf.get("use_dora"):
        raise UserError(
            f"peft.init_from={path} is a {conf.get('peft_type')} adapter of rank {conf.get('r')}, but this run "
            f"trains LoRA of rank peft.rank={peft.rank}. Set peft.rank={conf.get('r')} (and peft.alpha="
            f"{conf.get('lora_alpha')}) to continue that adapter, or drop peft.init_from."
        )
    theirs = conf.get("target_modules")
    theirs = [theirs] if isinstance(theirs, str) else sorted(theirs or [])
    if theirs != sorted(peft.target_modules):
        raise UserError(
            f"peft.init_from={path} adapts target_modules={theirs}, but peft.target_modules="
            f"{sorted(peft.target_modules)}. Set peft.target_modules=[{','.join(theirs)}] to continue that adapter."
        )
    from megatron_bridge.bridge.loader import HFCheckpoint

    base = HFCheckpoint(base_dir) if base_dir else None
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            if not key.startswith(PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
                raise UserError(f"peft.init_from={path}: tensor {key} is not a LoRA A/B weight of a module.")
            name = key[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0] + ".weight"
            shape = list(f.get_slice(key).get_shape())
            if base is None:
                continue
            if name not in base.infos:
                raise UserError(
                    f"peft.init_from={path} adapts {name}, which the base model {base_dir} does not have: "
                    "the adapter was trained on another model. Use the base it was made for (model.hf_path)."
                )
            out_f, in_f = list(base.slice(name).shape)
            want = [peft.rank, in_f] if ".lora_A." in key else [out_f, peft.rank]
            if shape != want:
                raise UserError(
                    f"peft.init_from={path}: {key} has shape {shape}, the base model {base_dir} needs {want}: "
                    "the adapter was trained on a model of another size. Use the base it was made for."
                )
    return conf


ADAPTER_DIR = "adapter"  # a peft=lora checkpoint's copy of its adapter in HF PEFT format


def export_checkpoint_adapter(cfg: Any) -> int:
    """`mbr export src=CKPT dst=DIR adapter=true`: the HF PEFT adapter a `peft=lora` training
    checkpoint carries (written at save time, checksummed by its manifest), verified and
    copied atomically. `src` is a checkpoint directory (its latest iteration) or one
    `iter_*` directory of it."""
    import shutil

    from megatron_bridge.convert.pipeline.run import atomic_output, check_paths
    from megatron_bridge.train import checkpoint as ck

    src, dst = check_paths(cfg.src, cfg.dst, cfg.overwrite)
    if not (src / ck.MANIFEST).is_file():
        it = ck.latest_iteration(src)
        if it is None:
            raise UserError(
                f"src={cfg.src} is not a training checkpoint (no {ck.MANIFEST}, no {ck.LATEST}). With adapter=true, "
                "point src at the checkpoint.dir of a peft=lora run or one of its iter_* directories."
            )
        src = ck.iter_dir(src, it)
    ck.verify(src)
    if not (src / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file():
        raise UserError(
            f"{src} holds no LoRA adapter: it was not written by a peft=lora run. Drop adapter=true to export "
            "an `mbr convert` output, or point src at a peft=lora checkpoint."
        )
    with atomic_output(dst) as tmp:
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copy2(src / ADAPTER_DIR / name, tmp / name)
    print(f"exported the LoRA adapter of {src} (HF PEFT format) to {dst}", flush=True)
    return 0


def layer_adapter_params(m: Any, peft: Any, *, tp: int = 1, etp: int = 1) -> tuple[float, float]:
    """LoRA parameters of one transformer layer on one rank, (dense, per local expert), for
    the planner: column-parallel adapters keep A whole and split B's rows, row-parallel ones
    split A's columns and keep B whole (as `lora_modules` lays them out). The HF modules'
    shapes follow from the megatron linear holding them (q/k/v rows, fc1's gate/up, ...).
    MoE models count every layer as MoE (plan.params counts a dense-first layer as dense;
    the adapters of those few layers are approximated)."""
    from megatron_bridge.bridge.registry import get_family

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
    "check_adapter_dir",
    "base_of",
    "layer_adapter_params",
    "export_checkpoint_adapter",
]
