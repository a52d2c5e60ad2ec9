"""Why: the words around the search's numbers.

`why_lost` names the step of the framework (evaluation.py's ranking, `Evaluation.key`) at
which a runner-up lost to the chosen layout, with the numbers that decided it;
`why_ruled_out` says by how much a valid layout misses the GPU memory; `diagnose` explains an infeasible request (kind
"rules": no candidate passes the layout rules; "batch": layouts fit but the global batch
cannot fill their pipeline; "memory": nothing fits the GPUs) and finds what would work:
the global batch the fitting layouts need, or the smallest cluster (by doubling
`cluster.nodes`) that holds the model.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_bridge.plan import memory as M
from megatron_bridge.plan.evaluation import Candidate, Context, Evaluation, evaluate
from megatron_bridge.plan.search import SearchResult, search


def smallest_cluster(ctx: Context, max_gpus: int = 1 << 20) -> tuple[int, Evaluation] | None:
    """The smallest power-of-two multiple of the current node count whose GPUs can hold
    the model (memory-only search, global batch relaxed so the pipeline can fill)."""
    nodes = max(1, ctx.world // ctx.gpn)
    while nodes * ctx.gpn <= max_gpus:
        world = nodes * ctx.gpn
        sub = replace(ctx, world=world, gbs=world * ctx.model.num_layers)
        r = search(sub, memory_only=True)
        if r.best is not None:
            return nodes, r.best
        nodes *= 2
    return None


def _gib(x: float) -> str:
    return f"{x / M.GIB:.1f} GiB"


def why_lost(alt: Evaluation, best: Evaluation, ctx: Context | None = None) -> str:
    """The framework step at which `alt` lost to `best`, in words, with the numbers
    (`ctx` lets it price `alt` with the winner's recompute policy)."""
    a, b = alt.layout, best.layout
    ka, kb = alt.key(), best.key()
    i = next((j for j, (x, y) in enumerate(zip(ka, kb)) if x != y), len(ka))
    t = f"est. step {alt.step_s:.2f} s vs {best.step_s:.2f} s"
    if i == 0:
        return (
            f"fits only because ZeRO-{a.dims.zero_stage} shards its model states over dp·cp={a.dims.dp * a.dims.cp}: the replica "
            f"alone needs {_gib(alt.alone_total)} of {_gib(alt.capacity)}; the framework sizes TP×PP so one "
            f"replica holds the model and keeps DP for throughput ({t})"
        )
    if i == 1:
        why = f"needs {a.recompute} recompute to fit where {b.recompute} suffices"
        if ctx is not None:
            other = min(
                (
                    evaluate(ctx, Candidate(replace(a.dims, vpp=v), b.recompute), with_comm=False)
                    for v in {a.dims.vpp, None}
                ),
                key=lambda e: e.alone_total,
            )
            why += f" (with {b.recompute} it needs {_gib(other.alone_total)} of {_gib(other.capacity)} without ZeRO)"
        return f"{why}: extra compute every step ({t})"
    if i == 2:
        return (
            f"{a.replica} GPUs per replica where {b.replica} suffice: more model parallelism than the model "
            f"needs (dp {a.dims.dp} vs {b.dims.dp}, bubble {alt.bubble:.1%} vs {best.bubble:.1%}; {t})"
        )
    if i == 3:
        instead = "pp" if a.dims.pp > b.dims.pp else ("cp" if a.dims.cp > b.dims.cp else "pp/cp")
        return f"tp{a.dims.tp} < tp{b.dims.tp} at the same replica size: {instead} does what NVLink TP does inside the node ({t})"
    if i == 4:
        diffs = {"bubble": (alt.compute_s * alt.bubble) - (best.compute_s * best.bubble)}
        for dim in set(alt.comm) | set(best.comm):
            diffs[f"{dim} comm"] = alt.comm.get(dim, {}).get("time_s", 0.0) - best.comm.get(dim, {}).get("time_s", 0.0)
        worst = max(diffs, key=diffs.__getitem__)
        return f"slower: {t}, mostly {worst} (+{diffs[worst]:.2f} s)"
    if i == 5:
        return (
            f"smaller micro batch ({a.dims.micro_batch_size} vs {b.dims.micro_batch_size}) at equal estimated step time"
        )
    return f"less headroom ({_gib(alt.headroom)} vs {_gib(best.headroom)})"


def why_ruled_out(ev: Evaluation) -> str:
    s = ev.binding
    where = "first" if s.stage == 0 else ("last" if s.stage == ev.layout.dims.pp - 1 else f"#{s.stage}")
    return (
        f"does not fit: {_gib(s.total)} > {_gib(ev.capacity)} on the {where} stage even with ZeRO-"
        f"{ev.layout.dims.zero_stage} and {ev.layout.recompute} recompute (states {_gib(s.weights + s.grads + s.optimizer)}, "
        f"activations {_gib(s.activations)})"
    )


def diagnose(ctx: Context, res: SearchResult) -> dict[str, object]:
    """Why nothing was chosen, and what would work: a larger global batch (when layouts
    fit in memory but cannot fill their pipeline) or the smallest cluster that fits."""
    out: dict[str, object] = {"kind": "memory", "reason": "", "smallest_cluster": None, "min_global_batch": None}
    top_rules = sorted(res.violations.items(), key=lambda kv: -kv[1])[:4]
    rules_txt = ", ".join(f"[{k}] ×{v}" for k, v in top_rules)
    relaxed = search(replace(ctx, gbs=ctx.world * ctx.model.num_layers), memory_only=True)
    if relaxed.best is not None:  # memory is fine once the batch can fill the pipeline
        lo = relaxed.best.layout
        need = lo.dims.micro_batch_size * lo.dims.dp * max(lo.dims.pp, 1)
        out["min_global_batch"] = need
        out["kind"] = "batch"
        out["reason"] = (
            f"layouts fit in memory on this cluster (e.g. {lo.short()}), but none can run "
            f"train.global_batch_size={ctx.gbs}: the layout rules refused every candidate ({rules_txt}). "
            f"{lo.short()} needs a global batch that is a multiple of micro·dp = {lo.dims.micro_batch_size * lo.dims.dp} with at "
            f"least pp={lo.dims.pp} microbatches, i.e. >= {need}: pass train.global_batch_size={need} or more."
        )
        return out
    if res.valid == 0 and relaxed.valid == 0:
        out["kind"] = "rules"
        shown = [res.examples[k] for k, _ in top_rules if k in res.examples][:3]
        out["reason"] = (
            "no candidate layout passes the layout rules: "
            + " ".join(shown)
            + (f" Pinned on the command line: {', '.join(ctx.pinned)}." if ctx.pinned else "")
            + " `mbr check` with the same arguments lists every rule a layout breaks."
        )
        return out
    closest = res.ruled_out[0] if res.ruled_out else (relaxed.ruled_out[0] if relaxed.ruled_out else None)
    found = smallest_cluster(ctx)
    parts = [
        f"{ctx.model.name} ({ctx.count.total:,} parameters) does not fit on {ctx.world // ctx.gpn} node(s) × "
        f"{ctx.gpn} GPUs of {_gib(ctx.capacity)}."
    ]
    if closest is not None:
        parts.append(f"Closest layout {closest.layout.short()}: {why_ruled_out(closest)}.")
    if found is not None:
        nodes, ev = found
        lo = ev.layout
        out["smallest_cluster"] = {
            "nodes": nodes,
            "gpus": nodes * ctx.gpn,
            "layout": lo.short(),
            "min_global_batch": lo.dims.micro_batch_size * lo.dims.dp * max(lo.dims.pp, 1),
        }
        parts.append(
            f"The smallest cluster that fits (doubling cluster.nodes) is {nodes} node(s) = {nodes * ctx.gpn} "
            f"GPUs, e.g. {lo.short()} ZeRO-{lo.dims.zero_stage} {lo.recompute} recompute at {_gib(ev.binding.total)} "
            f"per GPU, with a global batch >= {lo.dims.micro_batch_size * lo.dims.dp * max(lo.dims.pp, 1)}: pass cluster.nodes={nodes}."
        )
    else:
        parts.append(
            "No cluster size up to 2^20 GPUs fits it with these GPUs: the activations of one layer do not "
            "fit even at the largest TP/CP with full recompute; use GPUs with more memory or a shorter "
            "train.seq_length."
        )
    if ctx.pinned:
        parts.append(f"Pinned on the command line: {', '.join(ctx.pinned)} (drop them to widen the search).")
    out["reason"] = " ".join(parts)
    return out
