"""The parallelism decision framework (docs/plan.md) as a search: enumerate layouts, keep the valid ones that
fit, rank them by the framework's own order, say why each runner-up lost.

Validity is not re-derived here: every candidate becomes a `ParallelDims` and goes
through `rules.check_all`, the same rules `mbr check` applies. Each valid layout is
evaluated (evaluation.py: memory, communication, step time) at every recompute policy,
and the best per structure (tp, pp, cp, ep, etp) is kept, ranked by `Evaluation.key`
(evaluation.py says the order). This module holds the enumeration only: which degrees,
splits, micro batches and ZeRO stages are tried, and what the search counted.

explain.py turns the ranking into words (why each runner-up lost) and, when nothing fits,
finds what would (a larger global batch, the smallest cluster).

Pinned degrees: every `parallel.X=`, `zero.stage=`/`zero=`, `train.recompute=` and
`train.micro_batch_size=` given on the command line fixes that value; recipe values are
only defaults and are searched over.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import check_all
from megatron_bridge.plan import memory as M
from megatron_bridge.plan.evaluation import Candidate, Context, Evaluation, add_time, evaluate

MICRO_BATCHES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1, 2, 3)
PINNABLE = {
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.cp": "cp",
    "parallel.ep": "ep",
    "parallel.etp": "etp",
    "parallel.dp": "dp",
    "parallel.vpp": "vpp",
    "parallel.sequence_parallel": "sp",
    "parallel.layers_first_stage": "split",
    "parallel.layers_last_stage": "split",
    "zero.stage": "zero",
    "zero": "zero",
    "train.recompute": "recompute",
    "train.micro_batch_size": "mbs",
}


def pinned_from_overrides(overrides: Sequence[str]) -> list[str]:
    """Which searchable knobs the user fixed on the command line (`parallel.tp=8`, ...)."""
    out = []
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        if key in PINNABLE and PINNABLE[key] not in out:
            out.append(PINNABLE[key])
    return out


def _divisors(n: int) -> list[int]:
    """The divisors of `n` in increasing order (trial division to sqrt(n): a world of millions
    of GPUs is milliseconds, not a hang)."""
    if n <= 0:
        return []
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _splits(ctx: Context, pp: int) -> list[tuple[int | None, int | None]]:
    p = ctx.cfg.parallel
    if "split" in ctx.pinned:
        return [(p.layers_first_stage, p.layers_last_stage)]
    L = ctx.model.num_layers
    if L % pp == 0:
        return [(None, None)]
    if pp < 3:
        return []
    # Megatron's uneven split (Llama 3 405B: 126 layers on 16 stages = 7 + 14·8 + 7): the
    # first/last stages also hold the embedding/output layer, so they get fewer layers.
    for x in range(L // pp, 0, -1):
        if (L - 2 * x) % (pp - 2) == 0 and (L - 2 * x) // (pp - 2) >= x:
            return [(x, x)]
    return []


def _options(ctx: Context, name: str, default: list) -> list:
    if name not in ctx.pinned:
        return default
    p, t, z = ctx.cfg.parallel, ctx.cfg.train, ctx.cfg.zero
    value = {
        "tp": p.tp,
        "pp": p.pp,
        "cp": p.cp,
        "ep": p.ep,
        "etp": p.etp,
        "vpp": p.vpp,
        "sp": p.sequence_parallel,
        "zero": z.stage,
        "recompute": t.recompute,
        "mbs": t.micro_batch_size,
    }[name]
    return default if value is None else [value]  # a pinned null (sp: auto) searches


@dataclass
class SearchResult:
    ranked: list[Evaluation]  # feasible, best first, one per structure (tp, pp, cp, ep, etp)
    ruled_out: list[Evaluation]  # valid layouts that do not fit, least memory first, one per structure
    candidates: int = 0
    valid: int = 0
    feasible: int = 0
    seconds: float = 0.0
    violations: dict[str, int] = field(default_factory=dict)  # rule name -> candidates it refused
    examples: dict[str, str] = field(default_factory=dict)  # rule name -> its first message

    @property
    def best(self) -> Evaluation | None:
        return self.ranked[0] if self.ranked else None


def _proxy(cfg, parallel: SimpleNamespace, train: SimpleNamespace, zero: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(
        parallel=parallel,
        train=train,
        zero=zero,
        cluster=cfg.cluster,
        data=cfg.data,
        optimizer=cfg.optimizer,
        checkpoint=cfg.checkpoint,
        peft=cfg.peft,
        objective=cfg.objective,
        model=cfg.model,
    )


def search(ctx: Context, *, memory_only: bool = False) -> SearchResult:
    """Enumerate, validate with the rules, evaluate, rank. `memory_only` skips the
    micro-batch/vpp variants and step times (used to find the smallest cluster)."""
    t0 = time.perf_counter()
    cfg, m = ctx.cfg, ctx.model
    world, gpn, L = ctx.world, ctx.gpn, m.num_layers
    moe = bool(m.num_moe_experts)
    cross = cfg.parallel.allow_cross_node_tp
    train_d = {f: getattr(cfg.train, f) for f in cfg.train.__dataclass_fields__}
    train_d["global_batch_size"] = ctx.gbs
    zero_d = {f: getattr(cfg.zero, f) for f in cfg.zero.__dataclass_fields__}
    pin_dp = cfg.parallel.dp if "dp" in ctx.pinned else -1
    res = SearchResult(ranked=[], ruled_out=[])
    best_fit: dict[tuple, Evaluation] = {}
    best_miss: dict[tuple, Evaluation] = {}

    tps = _options(ctx, "tp", [d for d in _divisors(world) if d <= gpn or cross])
    zeros = _options(ctx, "zero", list(ZERO_STAGES))
    recomputes = _options(ctx, "recompute", list(M.RECOMPUTE))
    mbss = _options(ctx, "mbs", [1] if memory_only else list(MICRO_BATCHES))
    # Pinned values go to the rules as given (an impossible pin gets the rule's message);
    # searched values are bounded to divisors that could possibly be valid.
    for tp in tps:
        cps = _options(
            ctx, "cp", [d for d in _divisors(world // max(tp, 1)) if (tp * d <= gpn or cross) and 2 * d <= ctx.seq]
        )
        for cp in cps:
            pps = _options(ctx, "pp", [d for d in _divisors(world // max(tp * cp, 1)) if d <= L])
            for pp in pps:
                if pin_dp != -1 and tp * cp * pp * pin_dp != world:
                    continue
                eps = _options(ctx, "ep", _divisors(m.num_moe_experts or 0) if moe else [1])
                etps = [e if e is not None else tp for e in _options(ctx, "etp", sorted({tp, 1}) if moe else [tp])]
                sps = _options(ctx, "sp", [True, False] if tp > 1 else [False])
                for first, last in _splits(ctx, pp):
                    par = dict(
                        tp=tp,
                        pp=pp,
                        cp=cp,
                        dp=pin_dp,
                        layers_first_stage=first,
                        layers_last_stage=last,
                        allow_cross_node_tp=cross,
                    )
                    vpps = _options(
                        ctx,
                        "vpp",
                        [None]
                        + ([] if memory_only or first or last or pp < 2 else [v for v in _divisors(L // pp) if v > 1]),
                    )
                    for ep in eps:
                        for etp in etps:
                            for sp in sps:
                                if moe and tp > 1 and not sp:
                                    continue  # megatron-core: MoE with TP requires sequence parallelism
                                for zero in zeros:
                                    _search_mbs(
                                        ctx,
                                        res,
                                        best_fit,
                                        best_miss,
                                        par,
                                        train_d,
                                        zero_d,
                                        ep,
                                        etp,
                                        sp,
                                        zero,
                                        mbss,
                                        vpps,
                                        recomputes,
                                        memory_only,
                                    )
    key = Evaluation.key
    res.ranked = sorted(best_fit.values(), key=key)
    res.ruled_out = sorted(
        (e for st, e in best_miss.items() if st not in best_fit),
        key=lambda e: (e.binding.total / e.capacity, -e.layout.replica),
    )
    res.seconds = time.perf_counter() - t0
    return res


def _search_mbs(
    ctx, res, best_fit, best_miss, par, train_d, zero_d, ep, etp, sp, zero, mbss, vpps, recomputes, memory_only
) -> None:
    cfg = ctx.cfg
    for mbs in mbss:
        any_fit = False
        for vpp in vpps:
            res.candidates += 1
            parallel = SimpleNamespace(ep=ep, etp=etp, vpp=vpp, sequence_parallel=sp, **par)
            train = SimpleNamespace(**{**train_d, "micro_batch_size": mbs})
            zcfg = SimpleNamespace(**{**zero_d, "stage": zero})
            proxy = _proxy(cfg, parallel, train, zcfg)
            dims = ParallelDims.from_config(proxy, ctx.world, moe=ctx.model.is_moe)
            violations, _ = check_all(dims, ctx.model, proxy)
            if violations:
                for v in violations:
                    res.violations[v.rule] = res.violations.get(v.rule, 0) + 1
                    res.examples.setdefault(v.rule, str(v))
                continue
            res.valid += 1
            for rc in recomputes:
                lo = Candidate(dims, rc)
                ev = evaluate(ctx, lo, with_comm=False)
                st = lo.structure
                if ev.fits:
                    any_fit = True
                    res.feasible += 1
                    cur = best_fit.get(st)
                    if cur is not None and ev.key()[:4] > cur.key()[:4]:
                        continue  # loses before step time matters: skip pricing it
                    if not memory_only:
                        add_time(ctx, ev)
                    if cur is None or ev.key() < cur.key():
                        best_fit[st] = ev
                    if ev.fits_alone:
                        break  # more recompute only ranks lower
                elif st not in best_miss or ev.binding.total < best_miss[st].binding.total:
                    best_miss[st] = ev
        if not any_fit:
            break  # a larger micro batch only needs more memory
