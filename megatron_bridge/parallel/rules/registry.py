"""The rules, in one ordered list, and the functions that apply them.

`RULE_MODULES` is the order rules run in and violations are listed in (docs/config.md's
rule table follows it; a test holds the two together): the degrees, the model's shape under
them, the run, the model description, the values, LoRA, the objective. A new rule goes into the module of
its concern; a new concern is a module added here.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.errors import LayoutError
from megatron_bridge.parallel.dims import ParallelDims, padded_vocab_size
from megatron_bridge.parallel.rules import degrees, lora, model, objective, run, shapes, values
from megatron_bridge.parallel.rules.base import Rule, Violation

RULE_MODULES = (degrees, shapes, run, model, values, lora, objective)
RULES: tuple[Rule, ...] = tuple(r for m in RULE_MODULES for r in m.RULES)
LAYOUT_RULES: tuple[Rule, ...] = tuple(r for r in RULES if r.layout_rule)


def check_all(d: ParallelDims, spec: Any, cfg: Any, *, layout_only: bool = False) -> tuple[list[Violation], list[str]]:
    """Every rule (or only the layout rules), and the notes when nothing is violated."""
    violations: list[Violation] = []
    for r in LAYOUT_RULES if layout_only else RULES:
        violations += r(d, spec, cfg)
    return violations, (notes(d, spec, cfg) if not violations else [])


def validate(
    cfg: Any,
    spec: Any,
    world_size: int | None = None,
    *,
    dims: ParallelDims | None = None,
    layout_only: bool = False,
) -> tuple[ParallelDims, list[str]]:
    """Resolve (unless `dims` is given) and check a recipe whose model is described by `spec`.
    Returns (dims, notes); raises `LayoutError` listing every violated rule. `notes` are
    non-fatal findings (vocab padding, warnings). `layout_only` applies the layout rules alone
    (conversion, verification)."""
    if dims is None:
        dims = ParallelDims.from_config(cfg, world_size, moe=spec.is_moe)
    violations, found = check_all(dims, spec, cfg, layout_only=layout_only)
    if violations:
        raise LayoutError(violations, header=f"The layout {dims.describe()} breaks {len(violations)} rule(s):")
    return dims, found


def refuse(spec: Any, cfg: Any) -> None:
    """Raise LayoutError listing every violation of the rules that read no layout: for callers
    that validate many layouts of one recipe (`mbr plan`), which would otherwise reject each
    layout alike."""
    found = [v for r in RULES if "layout" not in r.reads for v in r(None, spec, cfg)]
    if found:
        raise LayoutError(found, header=f"The config breaks {len(found)} rule(s):")


def notes(d: ParallelDims, m: Any, cfg: Any) -> list[str]:
    """Non-fatal findings, printed with the rank map."""
    out = []
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, max(d.tp, 1))
    if padded != m.vocab_size:
        out.append(
            f"vocab {m.vocab_size} padded to {padded} (multiple of make_vocab_size_divisible_by·tp = "
            f"{m.make_vocab_size_divisible_by}·{d.tp})"
        )
    if d.tp > m.num_query_groups:
        out.append(
            f"KV heads ({m.num_query_groups}) < tp ({d.tp}): each TP rank holds part of one KV group; "
            "megatron-core gathers the K/V activations"
        )
    if cfg.parallel.sequence_parallel is None and d.sequence_parallel:
        out.append(
            f"sequence_parallel turned on automatically: MoE with tp={d.tp} needs it (megatron-core refuses "
            "to train MoE with TP otherwise); pin parallel.sequence_parallel=true to say so explicitly"
        )
    if d.sequence_parallel and d.tp == 1:
        out.append("sequence_parallel has no effect at tp=1 (megatron disables it)")
    if cfg.parallel.allow_cross_node_tp and (d.gpus_per_node or 1) % max(d.tp * d.cp, 1):
        out.append("warning: TP/CP groups cross node boundaries (allowed by parallel.allow_cross_node_tp)")
    return out + values.notes(m, cfg)


__all__ = ["RULE_MODULES", "RULES", "LAYOUT_RULES", "check_all", "validate", "refuse", "notes"]
