"""`objective=dpo | distill`: the data each needs, its values, and its frozen second model.

DPO trains on preference pairs and compares the policy with a frozen reference; distillation
trains towards a frozen teacher's token distributions. The second model (the reference when a
path names it, the teacher) is described once (`backends.frozen_model`) and held under the
policy's own TP/PP/EP layout, so it must exist, be buildable, share the student's vocabulary
(the vocab-parallel loss pairs the two models' logit shards column for column) and split
under the same degrees: each refused here, before any process group. The choices of
`objective.kind`, `loss` and `divergence` are checked with the other choices (`degrees.CHOICES`).
"""

from __future__ import annotations

from megatron_bridge.backends.frozen_model import frozen_spec, objective_model
from megatron_bridge.bridge.lora import base_of
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.rules import shapes
from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v

RULES = RuleSet()


def _lora(cfg) -> bool:
    return getattr(cfg.peft, "method", "none") == "lora"


@RULES.run(reads=("run",))
def objective_data(f: Facts) -> list[Violation]:
    """DPO's batches are (chosen, rejected) pairs, and only DPO reads such pairs."""
    cfg = f.run
    kind, data, out = cfg.objective.kind, cfg.data.kind, []
    if kind == "dpo" and data != "preference":
        out += _v(
            "dpo-data",
            f"objective=dpo trains on preference pairs (a prompt with a chosen and a rejected answer), but "
            f"data.kind={data}",
            "set data=preference with data.path naming the pairs (docs/finetune.md)",
        )
    if data == "preference" and kind != "dpo":
        out += _v(
            "preference-objective",
            f"data=preference holds (chosen, rejected) pairs, which only objective=dpo trains on "
            f"(objective.kind={kind})",
            "set objective=dpo, or data=sft to train on the chosen answers alone",
        )
    return out


@RULES.run(reads=("layout", "run"))
def dpo_layout(f: Facts) -> list[Violation]:
    d, cfg = f.layout, f.run
    if cfg.objective.kind == "dpo" and d.cp > 1:
        return _v(
            "dpo-cp",
            f"objective=dpo with parallel.cp={d.cp} is not supported yet: the per-sequence log-probabilities "
            "are not gathered over context-parallel ranks",
            "set parallel.cp=1 (use tp or pp for long sequences)",
        )
    return []


@RULES.run(reads=("model", "run"))
def dpo_reference(f: Facts) -> list[Violation]:
    """The reference is `objective.reference`, else the initial policy: its weights must come from
    somewhere (SimPO needs none; with LoRA it is the base, checked by `lora-base`)."""
    m, cfg = f.model, f.run
    o, out = cfg.objective, []
    if o.kind != "dpo":
        return []
    if o.reference is None and o.loss != "simpo" and not _lora(cfg) and not base_of(cfg, m):
        out += _v(
            "dpo-reference",
            f"objective=dpo (loss={o.loss}) compares the policy with a frozen reference; with "
            "objective.reference=null that is the initial policy, but neither model.hf_path nor train.init_from "
            "names its weights (a randomly initialised reference teaches nothing)",
            "set model.hf_path=DIR (or train.init_from=DIR), objective.reference=DIR, or objective.loss=simpo "
            "(reference-free)",
        )
    return out


@RULES.run(reads=("run",))
def objective_values(f: Facts) -> list[Violation]:
    """The values of the chosen objective (NaN and infinity are `finite-value`'s)."""
    o, out = f.run.objective, []
    if o.kind == "dpo":
        if not o.beta > 0:
            out += _v(
                "dpo-beta",
                f"objective.beta={o.beta:g} must be > 0 (it scales the log-probability ratios)",
                "set objective.beta=0.1 (TRL's default)",
            )
        if not 0 <= o.label_smoothing < 0.5:
            out += _v(
                "dpo-label-smoothing",
                f"objective.label_smoothing={o.label_smoothing:g} must lie in [0, 0.5): it is the probability "
                "that a pair's preference is flipped",
                "set objective.label_smoothing=0 (or e.g. 0.1 for conservative DPO)",
            )
        elif o.label_smoothing > 0 and o.loss != "sigmoid":
            out += _v(
                "dpo-label-smoothing",
                f"objective.label_smoothing={o.label_smoothing:g} applies to loss=sigmoid only "
                f"(objective.loss={o.loss})",
                "set objective.label_smoothing=0, or objective.loss=sigmoid",
            )
    if o.kind == "distill":
        if not o.temperature > 0:
            out += _v(
                "distill-temperature",
                f"objective.temperature={o.temperature:g} must be > 0 (logits are divided by it)",
                "set objective.temperature=1 (or 2 to soften both distributions)",
            )
        if not 0 <= o.alpha <= 1:
            out += _v(
                "distill-alpha",
                f"objective.alpha={o.alpha:g} must lie in [0, 1]: the divergence's share of the loss, cross "
                "entropy taking the rest",
                "set objective.alpha=0.5 (1 = divergence only, 0 = cross entropy only)",
            )
    return out


@RULES.run(reads=("model", "run"))
def frozen_model(f: Facts) -> list[Violation]:
    """The teacher (or a reference named by path) exists, is buildable and has the student's
    vocabulary; the config.json is read through the loader the student's description uses."""
    m, cfg = f.model, f.run
    if cfg.objective.kind == "distill" and not cfg.objective.teacher:
        return _v(
            "distill-teacher",
            "objective=distill trains towards a frozen teacher, but objective.teacher is not set",
            "set objective.teacher=DIR (a Hugging Face model directory or an `mbr convert` output)",
        )
    named = objective_model(cfg)
    if named is None:
        return []
    arg, path = named
    try:
        other = frozen_spec(cfg, m)
    except LayoutError as e:
        return [*e.violations]
    except UserError as e:
        return _v(
            "frozen-model",
            str(e).rstrip("."),
            f"point {arg} at a Hugging Face model directory or an `mbr convert` output",
        )
    if other is not None and other.vocab_size != m.vocab_size:
        return _v(
            "frozen-vocab",
            f"{arg}={path} has vocab_size={other.vocab_size}, the student {m.vocab_size}: the loss compares "
            "the two models' distributions token for token",
            f"use a {arg.split('.')[1]} with the student's tokenizer (vocab_size={m.vocab_size})",
        )
    return []


@RULES.run(reads=("layout", "model", "run"))
def frozen_layout(f: Facts) -> list[Violation]:
    """The second model splits under the policy's degrees: the shape rules, applied to it."""
    d, m, cfg = f.layout, f.model, f.run
    named = objective_model(cfg)
    try:
        other = frozen_spec(cfg, m)
    except (LayoutError, UserError):
        return []  # frozen_model's to report
    if other is None or named is None:
        return []
    out = []
    for rule in (r for r in shapes.RULES if "model" in r.reads):  # the rest read no model
        for v in rule(d, other, cfg):
            out += _v("frozen-layout", f"{named[0]}={named[1]}: {v.detail} (shape rule {v.rule})", v.fix)
    return out
