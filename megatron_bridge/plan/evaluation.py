"""One layout evaluated, and the order the search ranks layouts in.

A `Candidate` is a layout the rules accepted (`ParallelDims`) plus its recompute policy;
`evaluate` gives its memory on every stage that can bind (memory.py) and `add_time` its
bubble, communication per link and step time (comm.py); `Context` is what both read,
resolved once from the composed config. `Evaluation.key` is the framework's order
(docs/plan.md), best first:

  1. the replica fits by itself: its model states fit without ZeRO sharding over DP.
     The framework sizes model parallelism first (once TP × PP can hold the model, the
     remaining GPUs are DP with ZeRO); a layout that only fits because ZeRO shards its
     states over DP ranks after every layout that stands on its own.
  2. the least recompute: none < selective (re-runs attention, a few %) < full (+33%).
     Parallelism that avoids recomputation is preferred to recomputation.
  3. the fewest GPUs per replica (tp·pp·cp): TP just high enough that a layer fits, PP
     just high enough that the model fits, CP only when the sequence's activations need
     it; everything left is DP. EP is not part of the replica (megatron carves it out of
     dp·cp), so more EP is how an MoE model avoids more PP.
  4. more TP at the same replica size: TP stays on NVLink (rules keep it inside a node),
     PP pays a bubble.
  5. the estimated step time (bubble, exposed communication per link): picks vpp, ZeRO
     stage, sequence parallelism, CP vs PP at equal size, EP degree.
  6. a larger micro batch (better GEMM efficiency), then more memory headroom.

Kept apart from the enumeration (search.py) so explain.py can evaluate a layout of its own
(a runner-up at another setting, the smallest cluster) without the search loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from megatron_bridge.backends.frozen_model import held_model
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.config.schema import Config
from megatron_bridge.parallel.dims import ParallelDims, padded_vocab_size
from megatron_bridge.plan import comm as C
from megatron_bridge.plan import memory as M
from megatron_bridge.plan import params as P


@dataclass(frozen=True)
class Candidate:
    """One layout the planner evaluates: the `ParallelDims` the rules accepted (the type
    `mbr check` and training resolve, so what is planned is what is checked and built) and
    the recompute policy, the one knob the layout itself does not carry."""

    dims: ParallelDims
    recompute: str

    @property
    def replica(self) -> int:
        return self.dims.model_parallel

    @property
    def structure(self) -> tuple[int, ...]:
        d = self.dims
        return (d.tp, d.pp, d.cp, d.ep, d.etp)

    def short(self) -> str:
        d = self.dims
        s = f"tp{d.tp}·pp{d.pp}" + (f"·vpp{d.vpp}" if d.vpp else "") + f"·cp{d.cp}"
        if d.ep > 1 or d.etp != d.tp:
            s += f"·ep{d.ep}·etp{d.etp}"
        return s + f"·dp{d.dp}"


@dataclass
class Evaluation:
    layout: Candidate
    stages: list[M.StageMemory]
    binding: M.StageMemory
    alone_total: float  # the binding stage's total without ZeRO sharding
    capacity: float
    bubble: float = 0.0
    comm: dict[str, dict] = field(default_factory=dict)
    compute_s: float = 0.0
    step_s: float = 0.0
    spans: dict[str, bool] = field(default_factory=dict)

    @property
    def dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def fits(self) -> bool:
        return self.binding.total <= self.capacity

    @property
    def fits_alone(self) -> bool:
        return self.alone_total <= self.capacity

    @property
    def headroom(self) -> float:
        return self.capacity - self.binding.total

    def key(self) -> tuple:
        lo = self.layout
        return (
            0 if self.fits_alone else 1,
            M.RECOMPUTE.index(lo.recompute),
            lo.replica,
            -lo.dims.tp,
            round(self.step_s, 6),
            -lo.dims.micro_batch_size,
            -self.headroom,
        )


@dataclass
class Context:
    """Everything the search reads, resolved once from the composed config."""

    cfg: Config
    model: BridgeSpec  # the one description (backends.describe): what is counted is what is built
    count: P.ParamCount
    world: int
    gpn: int
    capacity: float
    engine: str
    precision: str
    seq: int
    gbs: int
    pinned: list[str]
    images: int = 1  # a VLM's images per sample
    patches: int = 0  # patches one image gives the vision tower (0: unknown, the tower's work left out)
    frozen: BridgeSpec | None = None  # the frozen second model held beside the policy (`held_model`)
    frozen_name: str = ""  # "teacher" | "reference"
    rows: int = 1  # sequences per sample: 2 for DPO (chosen and rejected)

    @classmethod
    def from_config(
        cls,
        cfg,
        model: BridgeSpec,
        pinned: Sequence[str] = (),
        world: int | None = None,
        gbs: int | None = None,
        images: int = 1,
        image_patches: int = 0,
    ) -> Context:
        """`image_patches`: the patches of one image where the vision config gives no fixed size
        (0: the description's `vision_patches`)."""
        c, t = cfg.cluster, cfg.train
        precision = t.precision if t.precision != "auto" else ("fp32" if c.backend == "gloo" else "bf16")
        held = held_model(cfg, model)
        return cls(
            cfg=cfg,
            model=model,
            count=backend_of(model).count(model),
            world=world or c.nodes * c.gpus_per_node,
            gpn=c.gpus_per_node,
            capacity=int(c.gpu_memory_gb * M.GIB),
            engine=t.engine,
            precision=precision,
            seq=t.seq_length,
            gbs=gbs or t.global_batch_size,
            pinned=list(pinned),
            images=images,
            patches=image_patches or model.vision_patches,
            frozen=held[1] if held else None,
            frozen_name=held[0] if held else "",
            rows=2 if cfg.objective.kind == "dpo" and not cfg.data.packing else 1,  # packed: whole pairs a row
        )


def stage_plan(L: int, dims: ParallelDims) -> list[tuple[int, tuple[int, ...], bool, bool]]:
    """(stage index, its global layer indices, is_first, is_last) for the stages that can
    bind: the first (embedding, most microbatches in flight), the second (most in flight
    among the middle ones) and the last (output layer, logits). The indices matter when
    layers differ (dense-first MoE models)."""
    pp = dims.pp
    stages = [0, 1, pp - 1] if pp > 2 else list(range(pp))
    return [(i, dims.stage_layer_ids(L, i), i == 0, i == pp - 1) for i in stages]


def evaluate(ctx: Context, lo: Candidate, *, with_comm: bool = True) -> Evaluation:
    """Memory of every binding stage; with_comm adds bubble, communication and step time."""
    m, dims = ctx.model, lo.dims
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, lo.dims.tp)
    edp = dims.expert_dp
    stages = [
        M.stage_memory(
            m,
            stage=idx,
            p=lo.dims.pp,
            layers=layers,
            first=first,
            last=last,
            tp=lo.dims.tp,
            cp=lo.dims.cp,
            ep=lo.dims.ep,
            etp=lo.dims.etp,
            dp=lo.dims.dp,
            edp=edp,
            zero=lo.dims.zero_stage,
            engine=ctx.engine,
            precision=ctx.precision,
            recompute=lo.recompute,
            sp=lo.dims.sequence_parallel,
            s=ctx.seq,
            b=lo.dims.micro_batch_size * ctx.rows,
            num_micro=lo.dims.grad_accum,
            vpp=lo.dims.vpp or 1,
            vocab=vocab,
            peft=getattr(ctx.cfg, "peft", None),
            images=ctx.images,
            patches=ctx.patches,
            frozen=ctx.frozen,
            frozen_layers=dims.stage_layer_ids(ctx.frozen.num_layers, idx) if ctx.frozen else (),
            frozen_logits=ctx.frozen_name == "teacher",
        )
        for idx, layers, first, last in stage_plan(m.num_layers, lo.dims)
    ]
    binding = max(stages, key=lambda x: x.total)
    ev = Evaluation(
        layout=lo,
        stages=stages,
        binding=binding,
        alone_total=max(x.alone for x in stages),
        capacity=ctx.capacity,
    )
    if with_comm and ev.fits:
        add_time(ctx, ev)
    return ev


def add_time(ctx: Context, ev: Evaluation) -> None:
    """Bubble, per-dimension communication and the step-time estimate of a layout."""
    m, lo, stages, edp = ctx.model, ev.layout, ev.stages, ev.dims.expert_dp
    c = ctx.cfg.cluster
    ev.spans = C.group_spans(
        tp=lo.dims.tp, cp=lo.dims.cp, dp=lo.dims.dp, pp=lo.dims.pp, ep=lo.dims.ep, etp=lo.dims.etp, gpn=ctx.gpn
    )
    ev.bubble = C.bubble_fraction(lo.dims.pp, lo.dims.vpp or 1, lo.dims.grad_accum)
    ids = lo.dims.stage_layer_ids(m.num_layers, 0)
    rp = (
        backend_of(m)
        .shards(m)
        .rank_params(tp=lo.dims.tp, ep=lo.dims.ep, etp=lo.dims.etp, layers=ids, first=True, last=lo.dims.pp == 1)
    )
    ab = 4 if ctx.precision == "fp32" else 2
    ev.comm = C.step_comm(
        m,
        tp=lo.dims.tp,
        cp=lo.dims.cp,
        dp=lo.dims.dp,
        pp=lo.dims.pp,
        ep=lo.dims.ep,
        etp=lo.dims.etp,
        edp=edp,
        vpp=lo.dims.vpp or 1,
        sp=lo.dims.sequence_parallel,
        zero=lo.dims.zero_stage,
        recompute=lo.recompute,
        s=ctx.seq,
        b=lo.dims.micro_batch_size * ctx.rows,
        num_micro=lo.dims.grad_accum,
        layers=max(s.layers for s in stages),
        dense_params=rp["dense"],
        expert_params=rp["expert"],
        spans=ev.spans,
        intra_gbps=c.intra_node_bandwidth_gbps,
        inter_gbps=c.inter_node_bandwidth_gbps,
        act_bytes=ab,
        grad_bytes=ab,
        weight_bytes=ab,
    )
    flops = C.step_flops(
        m,
        ctx.count,
        s=ctx.seq,
        global_batch=ctx.gbs * ctx.rows,
        recompute=lo.recompute,
        images=ctx.images,
        patches=ctx.patches,
    )
    ev.compute_s = C.compute_seconds(flops, ctx.world, c.peak_tflops, c.achieved_efficiency)
    ev.step_s = ev.compute_s * (1 + ev.bubble) + sum(x["time_s"] for x in ev.comm.values())
