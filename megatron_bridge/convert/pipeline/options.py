"""The layout check the conversion commands share, and their option checks (their config
fields are `schemas.py`).

`checked_layout` applies the layout rules (`parallel/rules/`, the ones `mbr check` and
training apply, minus the run rules about batches, schedules, engines and node placement,
which a checkpoint does not depend on) to the model the checkpoint holds, on the fewest
processes the degrees fit, then splits every tensor's shape over rank 0 — so a bad layout
is refused with every reason before a byte is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.bytemove.pool import resolve_workers
from megatron_bridge.convert.sources.rows import check_layout_shards
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import validate

FORMATS = ("torch_dist", "torch")


def check_workers(workers: int) -> int:
    """The `workers=` count to use (0 resolved to one per core), checked before anything is opened."""
    if workers < 0:
        raise UserError(f"workers={workers}: give the number of threads to convert with, or 0 for one per core")
    return resolve_workers(workers)


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise UserError(
            f"format={fmt!r}: choose torch_dist (megatron-core dist_checkpointing, any layout on load) "
            "or torch (Megatron's per-rank files for exactly parallel.*)"
        )
    return fmt


def checked_layout(
    cfg: Any, spec: BridgeSpec, hf_config: dict[str, Any], rows: Sequence[Resolved], tensors: dict[str, Any], fmt: str
) -> Layout:
    """The layout of `cfg.parallel`, validated for this checkpoint's model (see module doc)."""
    layout = ParallelDims.from_config(cfg, smallest_world=True, moe=spec.is_moe)
    try:
        validate(cfg, spec, dims=layout, layout_only=True)
    except LayoutError as e:
        raise LayoutError(e.violations, header=f"cannot lay the checkpoint out as {layout.degrees()}:") from None
    if fmt == "torch" and layout.etp != layout.tp:
        raise UserError(
            f"format=torch stores expert shards by tp rank, so it needs etp = tp (got etp={layout.etp}, "
            f"tp={layout.tp}); use format=torch_dist, which reshards on load"
        )
    check_layout_shards(spec, layout, rows, tensors)
    return layout


def describe(layout: Layout, dtype: Any | None) -> str:
    parts = [f"tp{layout.tp}", f"pp{layout.pp}"] + ([f"vpp{layout.vpp}"] if layout.vpp else [])
    parts += [f"ep{layout.ep}"] if layout.ep > 1 else []
    return "·".join(parts) + f", {str(dtype).replace('torch.', '') if dtype else 'source dtype'}"


__all__ = [
    "checked_layout",
    "check_format",
    "check_workers",
    "describe",
    "FORMATS",
]
