"""Where a parameter lives in Megatron's per-rank ("torch") checkpoint layout.

Megatron-LM's classic checkpoint is one `torch.save` file per (tp, pp, ep) rank:
`release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt` (PPP only when pp > 1, EEE only when
ep > 1, exactly as `megatron.training.checkpointing.get_checkpoint_name` builds it), holding
`model` (or `model0`, `model1`, ... per virtual pipeline chunk) = that rank's
`state_dict()`, plus `checkpoint_version`, `iteration` and `args`.

`release` rather than `iter_0000000`: Megatron-LM's tracker reader asserts
`iteration > 0 or release`, and a release checkpoint is what it loads for fine-tuning
(iteration reset to 0, no optimizer or RNG state expected).

Which parameter a rank holds, under which name, is its backend's decision (`Backend.owned`:
for the native backend the embedding on the first chunk, output layer and final norm on the
last, experts by EP rank), as is what a chunk's state dict holds besides (`Backend.rank_state`)
and the stored `args` (`Backend.checkpoint_args`); each (pp, vp) chunk's layers are the
layout's (`ParallelDims.stage_layers`: megatron-core's split as arithmetic, so the converter
does not import megatron-core); this module names the files and chunks they go to.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved

RELEASE = "release"
TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0


@dataclass(frozen=True, order=True)
class RankFile:
    tp: int
    pp: int
    ep: int

    def relpath(self, layout: Layout) -> str:
        name = f"mp_rank_{self.tp:02d}"
        if layout.pp > 1:
            name += f"_{self.pp:03d}"
        if layout.ep > 1:
            name += f"_{self.ep:03d}"
        return f"{RELEASE}/{name}/model_optim_rng.pt"


def chunk_key(layout: Layout, vp_stage: int | None) -> str:
    return "model" if vp_stage is None else f"model{vp_stage}"


@dataclass(frozen=True)
class Target:
    """One rank-local copy of a parameter: file, state-dict chunk, local name, coordinates."""

    file: RankFile
    chunk: str
    local: str
    coords: Coords


def stage_coords(layout: Layout, pp_rank: int) -> Iterator[Coords]:
    """Coordinates of every chunk stored in pipeline stage `pp_rank`'s files (etp = tp)."""
    for vp in range(layout.vpp) if layout.vpp else [None]:
        for ep in range(layout.ep):
            for tp in range(layout.tp):
                yield Coords(tp_rank=tp, pp_rank=pp_rank, ep_rank=ep, etp_rank=tp, vp_stage=vp)


def stage_targets(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved], pp_rank: int) -> dict[str, list[Target]]:
    """{global megatron name: its copies in stage `pp_rank`'s rank files}, in row order."""
    out: dict[str, list[Target]] = {}
    backend = backend_of(spec)
    for coords in stage_coords(layout, pp_rank):
        layers = layout.stage_layers(spec.num_layers, pp_rank, coords.vp_stage)
        f = RankFile(coords.tp_rank, pp_rank, coords.ep_rank)
        for r in rows:
            local = backend.owned(spec, r, layout, coords, layers)
            if local is not None:
                out.setdefault(r.megatron, []).append(Target(f, chunk_key(layout, coords.vp_stage), local, coords))
    return {r.megatron: out[r.megatron] for r in rows if r.megatron in out}


def all_targets(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved]) -> dict[str, list[Target]]:
    out: dict[str, list[Target]] = {}
    for pp in range(layout.pp):
        for name, targets in stage_targets(spec, layout, rows, pp).items():
            out.setdefault(name, []).extend(targets)
    return out


def common_state(args: argparse.Namespace) -> dict[str, object]:
    return {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}


__all__ = [
    "RankFile",
    "Target",
    "stage_coords",
    "stage_targets",
    "all_targets",
    "chunk_key",
    "common_state",
    "RELEASE",
    "TRACKER",
]
