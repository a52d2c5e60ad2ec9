"""The training objectives (`objective=lm|dpo|distill`, docs/finetune.md), built once per job by
`make_objective`; the engines call the `Objective` interface only (base.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_bridge.backends.frozen_model import frozen_spec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.lora_modules import adapters_off
from megatron_bridge.train.data.preference import rows_per_sample
from megatron_bridge.train.objectives.base import REPORT, NextToken, Objective
from megatron_bridge.train.objectives.distill import Distill
from megatron_bridge.train.objectives.dpo import DPO, precompute
from megatron_bridge.train.objectives.frozen import FrozenPass, frozen_model


def make_objective(
    cfg: Any, dims: Any, spec: Any, policy: Sequence[Any], overrides: dict[str, Any], datasets: Any
) -> Objective:
    """The objective `cfg.objective.kind` names, with its frozen model built under `dims`
    (`policy`: this rank's policy chunks, initialised; `overrides`: their TransformerConfig
    settings, so the frozen model runs in the training precision; `datasets`: the run's, whose
    pairs `objective.precompute_reference` computes the reference log-probabilities of)."""
    o = cfg.objective
    if o.kind == "lm":
        return NextToken()
    if o.kind == "dpo":
        reference = _reference(cfg, dims, spec, policy, overrides)
        if reference is not None and o.precompute_reference:  # one pass now; the reference is let go
            return DPO(cfg, None, precompute(reference, [datasets.train, datasets.valid], dims))
        return DPO(cfg, reference)
    if o.kind == "distill":
        teacher = frozen_model(frozen_spec(cfg, spec), dims, o.teacher, overrides=overrides)
        return Distill(cfg, FrozenPass(teacher, cfg, dims, 1), spec.vocab_size, pipelined=dims.pp > 1)
    raise UserError(f"objective={o.kind!r}: expected lm, dpo or distill")


def _reference(cfg, dims, spec, policy, overrides) -> FrozenPass | None:
    """DPO's reference: none for SimPO; `objective.reference`; else the initial policy — under
    LoRA the policy itself with its adapters off, otherwise a frozen copy of its starting weights
    (`train.init_from`, else `model.hf_path`; the objective rules refuse a run with neither)."""
    o = cfg.objective
    if o.loss == "simpo":
        return None
    if o.reference:
        chunks = frozen_model(frozen_spec(cfg, spec), dims, o.reference, overrides=overrides)
        return FrozenPass(chunks, cfg, dims, rows_per_sample(cfg.data))
    if cfg.peft.method == "lora":
        return FrozenPass(policy, cfg, dims, rows_per_sample(cfg.data), context=lambda: adapters_off(policy))
    source = cfg.train.init_from or spec.source
    if not source:
        raise UserError(
            "objective=dpo with objective.reference=null uses the initial policy as the reference, and this run "
            "starts from random weights: set model.hf_path or train.init_from (the policy's starting weights), or "
            "objective.reference=DIR"
        )
    return FrozenPass(frozen_model(spec, dims, source, overrides=overrides), cfg, dims, rows_per_sample(cfg.data))


__all__ = ["REPORT", "DPO", "Distill", "NextToken", "Objective", "make_objective"]
