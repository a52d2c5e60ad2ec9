"""`ParallelDims`: every parallel degree, stage split and batch size, resolved and frozen.

The one type that says how a model is laid out. `from_config` builds it from a composed
config (and, under a launcher, the real world size) and is the only place that reads
`cfg.parallel`; everything downstream is derived from the object, one function each:
the rank grid and process groups (`topology`, `groups`), megatron-core's TransformerConfig
(`runtime.tconfig.transformer_config`), DeepSpeed's config (`train.ds_config`), the
planner's candidates (`plan.search`), and the bridge's weight placement (`bridge.layout`,
which calls this type `Layout`). The pipeline split itself is a method here
(`stage_layers`), the one every consumer uses: the builder, the HF loader, the converter
and the planner. Nothing re-reads the config, so a degree the config check saw is the
degree the model is built with.

Converter and verifier layouts (`Layout.parse("tp2pp2")`, a checkpoint's manifest) have no
cluster: their `world_size` is None until a caller gives them one (`with_world`).

`from_config` only fills the inferred numbers (dp, grad accumulation, sequence parallelism
when left on auto); the rules that accept or refuse a layout live in `rules/` and run
through `rules.registry.validate()` before any process group exists.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from math import lcm
from typing import Any


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = None  # type: ignore[assignment]  # expert tensor parallel; None = tp, resolved in __post_init__
    vpp: int | None = None  # virtual pipeline chunks per rank (interleaved 1F1B); 1 = None
    sequence_parallel: bool = False
    # Uneven pipeline split: megatron-core num_layers_in_{first,last}_pipeline_stage.
    layers_first_stage: int | None = None
    layers_last_stage: int | None = None
    # The run: processes and batch arithmetic (None world: a layout without a cluster).
    world_size: int | None = None
    gpus_per_node: int | None = None
    dp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    global_batch_size: int = 1
    grad_accum: int = 1
    dp_inferred: bool = False

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.vpp == 1:  # one chunk per stage is no interleaving
            object.__setattr__(self, "vpp", None)

    # -- derived sizes (megatron-core's vocabulary) -----------------------------------
    @property
    def model_parallel(self) -> int:
        """Ranks holding one model replica: tp·pp·cp."""
        return self.tp * self.pp * self.cp

    @property
    def expert_grid(self) -> int:
        """etp·ep·pp: the ranks megatron-core lays one expert replica over."""
        return self.etp * self.ep * self.pp

    @property
    def smallest_world(self) -> int:
        """The fewest processes the degrees fit (both grids divide it)."""
        if min(self.model_parallel, self.expert_grid) < 1:
            return 1
        return lcm(self.model_parallel, self.expert_grid)

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world / (etp·ep·pp), as megatron-core builds it."""
        return (self.world_size or 0) // max(1, self.expert_grid)

    @property
    def num_microbatches(self) -> int:
        return self.grad_accum

    @property
    def nodes(self) -> int:
        return max(1, (self.world_size or 1) // max(1, self.gpus_per_node or 1))

    @property
    def vpp_or_1(self) -> int:
        return self.vpp or 1

    # -- the pipeline split ----------------------------------------------------------------
    def stage_layers(self, num_layers: int, pp_rank: int, vp_stage: int | None = None) -> range:
        """Global indices of the transformer layers chunk (`pp_rank`, `vp_stage`) holds: the one
        stage split, used by the builder, the HF loader, the converter and the planner.

        megatron-core 0.16's `get_transformer_layer_offset` / `get_num_layers_to_build` as plain
        arithmetic (no megatron import; tests/unit/parallel/test_stage_split.py holds them equal for every
        layout the rules accept): chunks are filled in schedule order, virtual stage major,
        then pipeline rank; each stage's layers split evenly over its `vpp` chunks, and
        `layers_first_stage` / `layers_last_stage` fix the end stages' counts (the middle
        stages share the rest). Without pipelining every layer is on the one stage. For a
        layout the rules refuse (layers not divisible) the counts are the floor of the split."""
        if self.pp == 1:
            return range(num_layers)
        sizes = self._chunk_sizes(num_layers)
        start = (vp_stage or 0) * sum(sizes) + sum(sizes[:pp_rank])
        return range(start, start + sizes[pp_rank])

    def stage_layer_ids(self, num_layers: int, pp_rank: int) -> tuple[int, ...]:
        """Every global layer pipeline stage `pp_rank` holds, over all its virtual chunks."""
        chunks = range(self.vpp) if self.vpp and self.pp > 1 else [None]
        return tuple(i for vp in chunks for i in self.stage_layers(num_layers, pp_rank, vp))

    def _chunk_sizes(self, num_layers: int) -> list[int]:
        """Layers in one virtual chunk of each pipeline stage (the same for every chunk of a stage)."""
        pp, vpp, first, last = self.pp, self.vpp_or_1, self.layers_first_stage, self.layers_last_stage
        middle = pp - (first is not None) - (last is not None)
        per_middle = (num_layers - (first or 0) - (last or 0)) // middle // vpp if middle > 0 else 0
        sizes = [per_middle] * pp
        if first is not None:
            sizes[0] = first // vpp
        if last is not None:
            sizes[-1] = last // vpp
        return sizes

    def degrees(self) -> str:
        """'tp2·pp2·vpp2·cp1·ep1' (+ etp when it differs from tp, the stage split, sp)."""
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        parts += [f"cp{self.cp}", f"ep{self.ep}"]
        if self.etp != self.tp:
            parts.append(f"etp{self.etp}")
        parts += _split_parts(self)
        return "·".join(parts) + (" sp" if self.sequence_parallel else "")

    def describe(self) -> str:
        """The degrees, and for a run also dp, ZeRO, world and batch arithmetic."""
        if self.world_size is None:
            return self.degrees()
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        parts += [f"cp{self.cp}", f"ep{self.ep}", f"etp{self.etp}", f"dp{self.dp or '?'}", *_split_parts(self)]
        sp = " sp" if self.sequence_parallel else ""
        return (
            f"{'·'.join(parts)}{sp} zero{self.zero_stage} world={self.world_size} "
            f"mbs={self.micro_batch_size} gbs={self.global_batch_size} accum={self.grad_accum or '?'}"
        )

    @staticmethod
    def sequence_parallel_required(moe: bool, tp: int) -> bool:
        """megatron-core refuses to train an MoE layer with TP but without SP (the expert
        weight gradients would be wrong): where `parallel.sequence_parallel=null` turns it on."""
        return moe and tp > 1

    def with_world(self, world_size: int) -> ParallelDims:
        """This layout on `world_size` processes of one node, the rest data parallel (what
        `mbr verify` and the parity tests run)."""
        mp = self.model_parallel
        return dataclasses.replace(
            self,
            world_size=world_size,
            gpus_per_node=world_size,
            dp=world_size // mp if mp > 0 and world_size % mp == 0 else 0,
            dp_inferred=True,
        )

    # -- construction -------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> ParallelDims:
        """'tp2pp2vpp2', 'tp2·cp2', 'ep2-tp2-sp' -> a layout (degrees default to 1)."""
        s = text.strip().lower()
        sp = s.endswith("sp") and not s.endswith("vsp")
        s = s[:-2] if sp else s
        kw: dict[str, Any] = {}
        for key, val in re.findall(r"(vpp|etp|tp|pp|cp|ep)(\d+)", s):
            kw[key] = int(val)
        rest = re.sub(r"(vpp|etp|tp|pp|cp|ep)\d+|[·.\-_ ]", "", s)
        if rest or not (kw or sp):
            raise ValueError(f"cannot parse layout {text!r} (expected e.g. tp2pp2vpp2, cp2tp2, ep2, tp2sp)")
        return cls(sequence_parallel=sp, **kw)

    @classmethod
    def from_config(
        cls, cfg, world_size: int | None = None, *, moe: bool, smallest_world: bool = False
    ) -> ParallelDims:
        """Resolve a composed `Config`. `world_size` defaults to the cluster's nodes ×
        gpus_per_node; under a launcher pass the real one. `smallest_world` sizes it to the
        fewest processes the degrees fit (the converter: a checkpoint has no cluster).
        Arithmetic that cannot be resolved (dp not inferable, batch not divisible) is left for
        `validate()` to report together with every other violation, so this never raises on
        bad numbers.

        `parallel.sequence_parallel=null` (auto) turns sequence parallelism on exactly where
        megatron-core requires it: an MoE model with tp > 1 (`moe`: the model description's
        `is_moe`; the recipe's model group is not read here)."""
        p, t, c = cfg.parallel, cfg.train, cfg.cluster
        sp = p.sequence_parallel
        if sp is None:
            sp = cls.sequence_parallel_required(moe, p.tp)
        degrees = cls(
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            etp=p.etp,
            vpp=p.vpp,
            sequence_parallel=bool(sp),
            layers_first_stage=p.layers_first_stage,
            layers_last_stage=p.layers_last_stage,
        )
        if smallest_world:
            world = degrees.smallest_world
        else:
            world = world_size if world_size is not None else c.nodes * c.gpus_per_node
        mp = degrees.model_parallel
        dp_inferred = p.dp == -1 or smallest_world
        dp = (world // mp if mp > 0 and world % mp == 0 else 0) if dp_inferred else p.dp
        per_step = t.micro_batch_size * dp
        if t.grad_accum is not None:
            accum = t.grad_accum
        else:
            accum = t.global_batch_size // per_step if per_step > 0 else 0
        return dataclasses.replace(
            degrees,
            world_size=world,
            gpus_per_node=world if smallest_world else c.gpus_per_node,
            dp=dp,
            zero_stage=cfg.zero.stage,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            grad_accum=accum,
            dp_inferred=dp_inferred,
        )


def _split_parts(d: ParallelDims) -> list[str]:
    out = []
    if d.layers_first_stage is not None:
        out.append(f"first{d.layers_first_stage}")
    if d.layers_last_stage is not None:
        out.append(f"last{d.layers_last_stage}")
    return out


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's vocab padding: round up to a multiple of divisible_by · tp."""
    m = divisible_by * tp
    return ((vocab + m - 1) // m) * m


__all__: list[str] = ["ParallelDims", "padded_vocab_size"]
