"""The description of an objective's frozen second model: the DPO reference or the
distillation teacher (`objective.reference`, `objective.teacher`).

Either is an HF directory (its config.json) or an `mbr convert` output (its manifest's HF
config and backend). It is described with the student's `make_vocab_size_divisible_by`, so a
teacher with the student's vocabulary pads to the same width and its logits shard over TP
exactly as the student's do. The rules check it and `mbr plan` counts it from this one
description; `objective_model` says which second model a recipe has.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from megatron_bridge.backends.describe import chosen_backend, describe, describe_hf
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.convert.formats.manifest import MANIFEST, Manifest
from megatron_bridge.errors import UserError


def objective_model(cfg: Any) -> tuple[str, str] | None:
    """(the key naming it, its path) of the recipe's frozen second model given by a path, or
    None (`objective=lm`, or a DPO reference that is the initial policy)."""
    o = cfg.objective
    if o.kind == "distill" and o.teacher:
        return "objective.teacher", str(o.teacher)
    if o.kind == "dpo" and o.reference:
        return "objective.reference", str(o.reference)
    return None


@lru_cache(maxsize=64)
def describe_frozen(path: str, *, arg: str, backend: str, divisor: int) -> BridgeSpec:
    """The model at `path` (`arg` names it in messages). Raises `UserError` when it is neither
    an HF directory nor a converted checkpoint, `LayoutError` when its backend cannot build it."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        man = Manifest.read(p)
        spec = describe_hf(man.hf_config, make_vocab_size_divisible_by=divisor, backend=man.backend)
        return dataclasses.replace(spec, source=path)
    if not (p / "config.json").is_file():
        raise UserError(
            f"{arg}={path} is neither a Hugging Face model directory (no config.json) nor an `mbr convert` "
            f"output (no {MANIFEST})"
        )
    return describe(SimpleNamespace(backend=backend, make_vocab_size_divisible_by=divisor), hf_path=p, arg=arg)


def frozen_spec(cfg: Any, student: BridgeSpec) -> BridgeSpec | None:
    """The second model's description (None without one given by a path), as `describe_frozen`."""
    named = objective_model(cfg)
    if named is None:
        return None
    arg, path = named
    return describe_frozen(
        path, arg=arg, backend=chosen_backend(cfg.model), divisor=student.make_vocab_size_divisible_by
    )


def held_model(cfg: Any, student: BridgeSpec) -> tuple[str, BridgeSpec] | None:
    """("teacher" | "reference", its description) of the frozen model a run holds beside the
    policy, or None: `objective=lm`, SimPO (reference-free), and a DPO reference=null with
    `peft=lora` (the base model with its adapters disabled, no second copy). A DPO
    reference=null otherwise is a frozen copy of the initial policy: the student's description."""
    o = cfg.objective
    if o.kind == "distill":
        spec = frozen_spec(cfg, student)
        return None if spec is None else ("teacher", spec)
    if o.kind != "dpo" or o.loss == "simpo":
        return None
    if o.reference:
        return "reference", frozen_spec(cfg, student) or student
    return None if getattr(cfg.peft, "method", "none") == "lora" else ("reference", student)


__all__ = ["objective_model", "describe_frozen", "frozen_spec", "held_model"]
