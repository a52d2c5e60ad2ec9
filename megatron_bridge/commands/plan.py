r"""`mbr plan`: which layout to use and why, before anyone spends a GPU-hour.

    mbr plan model=llama3_70b cluster=dgx_h100 cluster.nodes=8 train.seq_length=8192 \
        train.global_batch_size=512 [parallel.tp=8] [format=json] [top=5] [images=1 image_patches=N]

Composes the recipe (default: `recipe=default`) and overrides like every command, then
searches every layout of the cluster (megatron_bridge.plan.search). Any `parallel.X`,
`zero.stage`, `train.recompute` or `train.micro_batch_size` given on the command line is
pinned; recipe values are only defaults. Exit 0 with the plan; exit 3 when no layout fits
(with the smallest cluster or the global batch that would); exit 2 for bad input,
including pinned degrees that break a layout rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import parse_command, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules.registry import refuse
from megatron_bridge.plan import explain, report
from megatron_bridge.plan.evaluation import Context
from megatron_bridge.plan.search import pinned_from_overrides, search

FORMATS = ("table", "json")


class InfeasiblePlan(UserError):
    """The request is well-formed but no layout fits: exit 3, distinct from bad input."""

    exit_code = 3


@dataclass
class PlanConfig(Config):
    format: str = "table"  # table | json
    top: int = 5  # alternatives to show
    # a vision-language model (docs/plan.md "Vision-language models"): images per sample, and the
    # patches one image gives the vision tower where its config has no fixed image size (0: that size)
    images: int = 1
    image_patches: int = 0


MAX_WORLD = 1 << 22  # GPUs: the search's divisor loops stay instant below it


def plan(argv: Sequence[str]):
    """Compose and search; returns (config, args, document). Library entry point."""
    cfg, args = parse_command(argv, PlanConfig, doc=__doc__)
    if cfg.format not in FORMATS:
        raise UserError(f"format={cfg.format!r} is not one of {', '.join(FORMATS)}; use format=table or format=json.")
    if cfg.top < 0:
        raise UserError(f"top={cfg.top} must be >= 0 (the number of alternatives to show).")
    if cfg.cluster.nodes < 1 or cfg.cluster.gpus_per_node < 1 or cfg.cluster.gpu_memory_gb <= 0:
        raise UserError("cluster.nodes, cluster.gpus_per_node and cluster.gpu_memory_gb must be positive.")
    if cfg.images < 0 or cfg.image_patches < 0:
        raise UserError(
            f"images={cfg.images} image_patches={cfg.image_patches}: the images per sample and the patches per image "
            "are counts (>= 0); give e.g. images=1 image_patches=1024."
        )
    eff = cfg.cluster.achieved_efficiency
    if eff is not None and not 0 < eff <= 1:
        raise UserError(
            f"cluster.achieved_efficiency={eff} is not a fraction of peak in (0, 1]; give e.g. "
            "cluster.achieved_efficiency=0.45, or null for the default fitted to published runs (docs/plan.md)."
        )
    if cfg.cluster.nodes * cfg.cluster.gpus_per_node > MAX_WORLD:
        raise UserError(
            f"cluster.nodes={cfg.cluster.nodes} x cluster.gpus_per_node={cfg.cluster.gpus_per_node} is more than "
            f"{MAX_WORLD} GPUs, beyond any cluster the plan can describe; give the cluster you have "
            "(e.g. cluster.nodes=8)."
        )
    if args.cfg:
        return cfg, args, None
    model = describe(cfg.model)
    refuse(model, cfg)  # a bad lr is bad input (exit 2), not a layout that does not fit
    pinned = pinned_from_overrides(args.overrides)
    ctx = Context.from_config(cfg, model, pinned, images=cfg.images, image_patches=cfg.image_patches)
    res = search(ctx)
    diagnosis = explain.diagnose(ctx, res) if res.best is None else None
    return cfg, args, report.build(ctx, res, top=cfg.top, diagnosis=diagnosis)


def main(argv: Sequence[str]) -> int:
    cfg, args, doc = plan(argv)
    if doc is None:
        print(to_yaml(cfg), end="")
        return 0
    # Pins that no layout can honour are bad input (exit 2, like `mbr check`); a request
    # that is fine but does not fit is exit 3.
    bad_pins = not doc["feasible"] and doc["infeasible"]["kind"] == "rules" and doc["pinned"]
    if cfg.format == "json":
        print(report.to_json(doc))
        return 0 if doc["feasible"] else (UserError.exit_code if bad_pins else InfeasiblePlan.exit_code)
    if not doc["feasible"]:
        reason = str(doc["infeasible"]["reason"])
        raise UserError(reason) if bad_pins else InfeasiblePlan(reason)
    print(report.to_table(doc))
    return 0
