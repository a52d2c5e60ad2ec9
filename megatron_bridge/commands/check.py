"""`mbr check`: compose a recipe, validate its layout, print the rank map.

Exit 0 with the rank map, or exit 2 with every violated rule. Creates no process group
and imports no torch: it answers for 16,384 ranks in well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_bridge.backends.describe import describe
from megatron_bridge.backends.frozen_model import held_model
from megatron_bridge.config.compose import parse_command, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.parallel.topology import Topology
from megatron_bridge.plan.evaluation import Candidate, Context, evaluate
from megatron_bridge.plan.memory import GIB


def frozen_memory(cfg, model, dims) -> str:
    """The line on the objective's frozen second model (a teacher, a DPO reference) each rank
    holds beside the policy, from the planner's own count (plan/memory.py); "" without one."""
    held = held_model(cfg, model)
    if held is None:
        return ""
    stages = evaluate(Context.from_config(cfg, model), Candidate(dims, cfg.train.recompute), with_comm=False).stages
    weights, logits = max(s.frozen_weights for s in stages), max(s.frozen_logits for s in stages)
    unit, name = (GIB, "GiB") if max(weights, logits) >= GIB / 4 else (2**20, "MiB")  # as `mbr plan`'s table
    extra = f", {held[0]} logits {logits / unit:.1f} {name} on the last stage" if logits else ""
    return (
        f"frozen {held[0]}: weights {weights / unit:.1f} {name} per rank (largest stage){extra}; no gradients, "
        "no optimizer state (`mbr plan`: the whole memory budget)"
    )


def main(argv: Sequence[str]) -> int:
    cfg, args = parse_command(argv, Config, doc=__doc__)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    model = describe(cfg.model)
    dims, notes = validate(cfg, model)
    full = "--full" in args.flags
    print(
        f"recipe {args.recipe}: model {model.name} on {dims.nodes} node(s) × {dims.gpus_per_node} ({cfg.cluster.name})"
    )
    print(f"layout OK: {dims.describe()}")
    for n in notes:
        print(f"note: {n}")
    frozen = frozen_memory(cfg, model, dims)
    if frozen:
        print(frozen)
    print(Topology(dims).format_rank_map(max_nodes=dims.nodes if full else 4, moe=model.is_moe))
    return 0
