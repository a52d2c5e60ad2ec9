"""`mbr check`: compose a recipe, validate its layout, print the rank map.

Exit 0 with the rank map, or exit 2 with every violated rule. Creates no process group
and imports no torch: it answers for 16,384 ranks in well under a second.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import parse_command, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.parallel.topology import Topology


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
    print(Topology(dims).format_rank_map(max_nodes=dims.nodes if full else 4, moe=model.is_moe))
    return 0
