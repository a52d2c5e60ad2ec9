"""`ParallelDims`: every parallel degree and batch size, resolved and frozen.

Built once from the composed config (and, under a launcher, the real world size), then
passed downstream unchanged: the rank grid, the process groups, the planner and the
engines all read the same object. `resolve` only fills the two inferred numbers (dp and
grad accumulation); the rules that accept or refuse a layout live in `rules.py` and run
through `validate()` before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_bridge.errors import LayoutError


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    gpus_per_node: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    dp: int = 1
    vpp: int | None = None
    sequence_parallel: bool = False
    zero_stage: int = 0
    micro_batch_size: int = 1
    global_batch_size: int = 1
    grad_accum: int = 1
    dp_inferred: bool = False

    # -- derived sizes (megatron-core's vocabulary) -----------------------------------
    @property
    def model_parallel(self) -> int:
        """Ranks holding one model replica: tp·pp·cp."""
        return self.tp * self.pp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world / (etp·ep·pp), as megatron-core builds it."""
        return self.world_size // max(1, self.etp * self.ep * self.pp)

    @property
    def num_microbatches(self) -> int:
        return self.grad_accum

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // max(1, self.gpus_per_node))

    @property
    def vpp_or_1(self) -> int:
        return self.vpp or 1

    def describe(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp:
            parts.append(f"vpp{self.vpp}")
        parts += [f"cp{self.cp}", f"ep{self.ep}", f"etp{self.etp}", f"dp{self.dp or '?'}"]
        sp = " sp" if self.sequence_parallel else ""
        return (
            f"{'·'.join(parts)}{sp} zero{self.zero_stage} world={self.world_size} "
            f"mbs={self.micro_batch_size} gbs={self.global_batch_size} accum={self.grad_accum or '?'}"
        )

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg, world_size: int | None = None) -> ParallelDims:
        """Resolve degrees from a composed `Config`. `world_size` defaults to the cluster's
        nodes × gpus_per_node; under a launcher pass the real one. Arithmetic that cannot
        be resolved (dp not inferable, batch not divisible) is left for `validate()` to
        report together with every other violation, so this never raises on bad numbers."""
        p, t, c = cfg.parallel, cfg.train, cfg.cluster
        world = world_size if world_size is not None else c.nodes * c.gpus_per_node
        mp = p.tp * p.pp * p.cp
        dp_inferred = p.dp == -1
        dp = (world // mp if mp > 0 and world % mp == 0 else 0) if dp_inferred else p.dp
        per_step = t.micro_batch_size * dp
        if t.grad_accum is not None:
            accum = t.grad_accum
        else:
            accum = t.global_batch_size // per_step if per_step > 0 else 0
        return cls(
            world_size=world,
            gpus_per_node=c.gpus_per_node,
            tp=p.tp,
            pp=p.pp,
            cp=p.cp,
            ep=p.ep,
            etp=p.etp if p.etp is not None else p.tp,
            dp=dp,
            vpp=p.vpp,
            sequence_parallel=p.sequence_parallel,
            zero_stage=cfg.zero.stage,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            grad_accum=accum,
            dp_inferred=dp_inferred,
        )


def validate(cfg, world_size: int | None = None):
    """Resolve and check a config. Returns (dims, notes); raises `LayoutError` listing
    every violated rule. `notes` are non-fatal findings (vocab padding, warnings)."""
    from megatron_bridge.parallel.rules import check_all

    dims = ParallelDims.from_config(cfg, world_size)
    violations, notes = check_all(dims, cfg)
    if violations:
        raise LayoutError(
            violations,
            header=f"The layout {dims.describe()} breaks {len(violations)} rule(s):",
        )
    return dims, notes


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's vocab padding: round up to a multiple of divisible_by · tp."""
    m = divisible_by * tp
    return ((vocab + m - 1) // m) * m


__all__: list[str] = ["ParallelDims", "validate", "padded_vocab_size"]
