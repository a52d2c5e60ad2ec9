"""The plan as data (the JSON schema of docs/plan.md) and as a table for people.

One function builds the document (`build`); `to_json` and `to_table` only render it, so
the table can never show a number the JSON does not carry. Bytes are bytes in the JSON and
GiB in the table; times are seconds. The rank map summary of the chosen layout comes from
`Topology.span_summary` (the same rank grid `mbr check` prints); runner-ups use the
arithmetic equivalent from comm.group_spans.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_bridge.parallel.topology import Topology
from megatron_bridge.plan import comm as C
from megatron_bridge.plan import explain as X
from megatron_bridge.plan import memory as M
from megatron_bridge.plan.evaluation import Context, Evaluation
from megatron_bridge.plan.search import SearchResult

SCHEMA = "mbr.plan/1"


def _layout(ev: Evaluation) -> dict[str, object]:
    lo = ev.layout
    return {
        "tp": lo.dims.tp,
        "pp": lo.dims.pp,
        "vpp": lo.dims.vpp,
        "cp": lo.dims.cp,
        "ep": lo.dims.ep,
        "etp": lo.dims.etp,
        "dp": lo.dims.dp,
        "zero_stage": lo.dims.zero_stage,
        "sequence_parallel": lo.dims.sequence_parallel,
        "recompute": lo.recompute,
        "micro_batch_size": lo.dims.micro_batch_size,
        "grad_accum": lo.dims.grad_accum,
        "layers_first_stage": lo.dims.layers_first_stage,
        "layers_last_stage": lo.dims.layers_last_stage,
    }


def overrides(ev: Evaluation) -> str:
    """The command-line overrides that set this layout (for `mbr check` / training)."""
    lo = ev.layout
    out = [f"parallel.tp={lo.dims.tp}", f"parallel.pp={lo.dims.pp}", f"parallel.cp={lo.dims.cp}"]
    if lo.dims.vpp:
        out.append(f"parallel.vpp={lo.dims.vpp}")
    if lo.dims.ep > 1 or lo.dims.etp != lo.dims.tp:
        out += [f"parallel.ep={lo.dims.ep}", f"parallel.etp={lo.dims.etp}"]
    if lo.dims.layers_first_stage is not None:
        out += [
            f"parallel.layers_first_stage={lo.dims.layers_first_stage}",
            f"parallel.layers_last_stage={lo.dims.layers_last_stage}",
        ]
    out += [
        f"parallel.sequence_parallel={str(lo.dims.sequence_parallel).lower()}",
        f"zero.stage={lo.dims.zero_stage}",
        f"train.recompute={lo.recompute}",
        f"train.micro_batch_size={lo.dims.micro_batch_size}",
    ]
    return " ".join(out)


def _plan(ev: Evaluation, ctx: Context, rank_map: dict[str, str]) -> dict[str, object]:
    lo, b = ev.layout, ev.binding
    comm_s = sum(x["time_s"] for x in ev.comm.values())
    return {
        "layout": _layout(ev),
        "describe": ev.dims.describe(),
        "overrides": overrides(ev),
        "replica_gpus": lo.replica,
        "memory": {
            "capacity_bytes": ev.capacity,
            "total_bytes": b.total,
            "headroom_bytes": ev.headroom,
            "without_zero_bytes": ev.alone_total,
            "fits_without_zero": ev.fits_alone,
            "binding_stage": b.stage,
            "frozen_model": ctx.frozen_name or None,
            "params_per_gpu": b.params,
            "stages": [s.as_dict() for s in ev.stages],
        },
        "pipeline": {
            "bubble_fraction": ev.bubble,
            "num_microbatches": lo.dims.grad_accum,
            "vpp": lo.dims.vpp or 1,
            "formula": "(pp-1)/(vpp*microbatches)",
        },
        "communication": ev.comm,
        "time": {
            "compute_s": ev.compute_s,
            "bubble_s": ev.compute_s * ev.bubble,
            "comm_s": comm_s,
            "step_s": ev.step_s,
            "assumed_mfu": ctx.cfg.cluster.achieved_efficiency or C.ACHIEVED_EFFICIENCY,
        },
        "rank_map": rank_map,
    }


def _spans_words(ev: Evaluation) -> dict[str, str]:
    lo = ev.layout
    sizes = {
        "tp": lo.dims.tp,
        "cp": lo.dims.cp,
        "dp": lo.dims.dp,
        "dp_cp": lo.dims.dp * lo.dims.cp,
        "pp": lo.dims.pp,
        "ep": lo.dims.ep,
        "edp": ev.dims.expert_dp,
    }
    return {k: ("intra-node" if v else "inter-node") for k, v in ev.spans.items() if sizes.get(k, 1) > 1}


def build(
    ctx: Context, res: SearchResult, top: int = 5, diagnosis: dict[str, object] | None = None
) -> dict[str, object]:
    cfg, cnt = ctx.cfg, ctx.count
    doc: dict[str, object] = {
        "schema": SCHEMA,
        "feasible": res.best is not None,
        "model": {
            "name": ctx.model.name,
            "family": ctx.model.family,
            "params_total": cnt.total,
            "params_active": cnt.active,
            "params_embedding": cnt.embedding,
            "params_per_layer": cnt.per_layer,
            "num_layers": ctx.model.num_layers,
            "moe": ctx.model.is_moe,
            "vision": _vision(ctx),
        },
        "cluster": {
            "name": cfg.cluster.name,
            "nodes": ctx.world // ctx.gpn,
            "gpus_per_node": ctx.gpn,
            "world_size": ctx.world,
            "gpu_memory_bytes": ctx.capacity,
            "intra_node_bandwidth_gbps": cfg.cluster.intra_node_bandwidth_gbps,
            "inter_node_bandwidth_gbps": cfg.cluster.inter_node_bandwidth_gbps,
            "peak_tflops": cfg.cluster.peak_tflops,
        },
        "train": {
            "seq_length": ctx.seq,
            "global_batch_size": ctx.gbs,
            "precision": ctx.precision,
            "engine": ctx.engine,
        },
        "pinned": ctx.pinned,
        "choice": None,
        "alternatives": [],
        "fewer_stages": [],
        "ruled_out": [],
        "search": {
            "candidates": res.candidates,
            "valid": res.valid,
            "fitting": res.feasible,
            "seconds": res.seconds,
            "refused_by_rule": res.violations,
        },
    }
    best = res.best
    if best is not None:
        topo = Topology(best.dims).span_summary(moe=ctx.model.is_moe)
        doc["choice"] = _plan(best, ctx, topo)
        doc["alternatives"] = [
            dict(_plan(e, ctx, _spans_words(e)), rank=i + 2, why_lost=X.why_lost(e, best, ctx))
            for i, e in enumerate(res.ranked[1 : top + 1])
        ]
        doc["fewer_stages"] = _fewer_stages(ctx, res, best)
    doc["ruled_out"] = [
        {"layout": _layout(e), "describe": e.layout.short(), "needs_bytes": e.binding.total, "why": X.why_ruled_out(e)}
        for e in res.ruled_out[:3]
    ]
    if diagnosis is not None:
        doc["infeasible"] = diagnosis
    return doc


def _vision(ctx: Context) -> dict[str, object] | None:
    """A VLM's vision pieces as the plan counts them (None for a text model)."""
    m = ctx.model
    if not m.vision_params:
        return None
    return {
        "params": m.vision_params,
        "stage": 0,
        "images_per_sample": ctx.images,
        "patches_per_image": ctx.patches,
        "forward_flops_per_image": C.vision_flops(m, patches=ctx.patches),
    }


def _fewer_stages(ctx: Context, res: SearchResult, best: Evaluation) -> list[dict[str, object]]:
    """The framework's "why not fewer stages" (docs/plan.md): the same tp/cp/ep with the next smaller pp values,
    whether they fit (and lost) or not."""
    b = best.layout

    def same(e: Evaluation) -> bool:
        return (e.dims.tp, e.dims.cp, e.dims.ep, e.dims.etp) == (b.dims.tp, b.dims.cp, b.dims.ep, b.dims.etp)

    found = [(e, True) for e in res.ranked if same(e) and e.layout.dims.pp < b.dims.pp]
    found += [(e, False) for e in res.ruled_out if same(e) and e.layout.dims.pp < b.dims.pp]
    found.sort(key=lambda x: -x[0].layout.dims.pp)
    return [
        {
            "describe": e.layout.short(),
            "pp": e.layout.dims.pp,
            "fits": fits,
            "why": X.why_lost(e, best, ctx) if fits else X.why_ruled_out(e),
        }
        for e, fits in found[:2]
    ]


def to_json(doc: dict[str, object]) -> str:
    return json.dumps(doc, indent=2, default=float)


# -- table -----------------------------------------------------------------------------
def _g(x: float, unit: float = M.GIB) -> str:
    return f"{x / unit:8.2f}"


def _vol(x: float) -> str:
    return f"{x / 1e9:10.2f} GB"


def to_table(doc: dict[str, Any]) -> str:
    m, c, t = doc["model"], doc["cluster"], doc["train"]
    L: list[str] = []
    active = f", {m['params_active']:,} active" if m["moe"] else ""
    L.append(
        f"model    {m['name']} ({m['family']}): {m['params_total']:,} parameters{active}, {m['num_layers']} layers"
    )
    if m["vision"]:
        v = m["vision"]
        work = (
            f"{v['images_per_sample']} image(s) per sample of {v['patches_per_image']:,} patches, "
            f"{v['forward_flops_per_image'] / 1e9:.3g} GFLOP forward per image"
            if v["patches_per_image"]
            else "patches per image unknown (dynamic resolution): its FLOPs and activations are left out; "
            "give image_patches=N"
        )
        L.append(f"vision   tower + projector {v['params']:,} parameters on stage 0 (whole on every TP rank); {work}")
    L.append(
        f"cluster  {c['name']}: {c['nodes']} node(s) x {c['gpus_per_node']} = {c['world_size']:,} GPUs of "
        f"{c['gpu_memory_bytes'] / M.GIB:.0f} GiB; NVLink {c['intra_node_bandwidth_gbps']:g} GB/s, "
        f"inter-node {c['inter_node_bandwidth_gbps']:g} GB/s per GPU"
    )
    L.append(
        f"training seq {t['seq_length']}, global batch {t['global_batch_size']}, {t['precision']}, "
        f"engine {t['engine']}" + (f"; pinned: {', '.join(doc['pinned'])}" if doc["pinned"] else "")
    )
    ch = doc["choice"]
    if ch is None:
        L.append("")
        L.append("NO LAYOUT FITS. " + str(doc.get("infeasible", {}).get("reason", "")))
        return "\n".join(L)
    lo, mem = ch["layout"], ch["memory"]
    L.append("")
    vpp = f" vpp {lo['vpp']}" if lo["vpp"] else ""
    split = (
        f" (layers {lo['layers_first_stage']} first / {lo['layers_last_stage']} last)"
        if lo["layers_first_stage"] is not None
        else ""
    )
    L.append(
        f"CHOSEN   tp {lo['tp']}  pp {lo['pp']}{vpp}  cp {lo['cp']}  ep {lo['ep']}  dp {lo['dp']}  "
        f"zero {lo['zero_stage']}  sequence_parallel {'on' if lo['sequence_parallel'] else 'off'}  "
        f"recompute {lo['recompute']}{split}"
    )
    L.append(
        f"         micro batch {lo['micro_batch_size']}, grad accumulation {lo['grad_accum']} microbatch(es) "
        f"per step; replica tp*pp*cp = {ch['replica_gpus']} GPUs"
    )
    alone = "fits" if mem["fits_without_zero"] else "does NOT fit"
    L.append(f"         the replica {alone} without ZeRO ({mem['without_zero_bytes'] / M.GIB:.1f} GiB per GPU)")
    L.append(f"         {ch['overrides']}")
    L.append("")
    unit, uname = (M.GIB, "GiB") if mem["total_bytes"] >= M.GIB / 4 else (2**20, "MiB")
    L.append(
        f"memory per GPU, {uname} (stage {mem['binding_stage']} binds)  "
        + "  ".join(f"{'stage ' + str(s['stage']):>8}" for s in mem["stages"])
    )
    frozen = mem.get("frozen_model")
    rows = [
        ("params", "parameters (count, G)"),
        ("weights", "weights"),
        ("grads", "gradients"),
        ("optimizer", "optimizer states"),
        ("activations", "activations"),
        ("logits", "logits"),
        *([("frozen_weights", f"{frozen} weights")] if frozen else []),
        *([("frozen_logits", f"{frozen} logits")] if frozen == "teacher" else []),
        ("fragmentation", f"fragmentation {M.FRAGMENTATION:.0%}"),
        ("total", "total"),
    ]
    for key, label in rows:
        vals = [(f"{s[key] / 1e9:8.3f}" if key == "params" else _g(s[key], unit)) for s in mem["stages"]]
        L.append(f"  {label:<36}" + "  ".join(vals))
    L.append(f"  {'capacity / headroom':<36}{_g(mem['capacity_bytes'], unit)}  {_g(mem['headroom_bytes'], unit)}")
    L.append("")
    pl, tm = ch["pipeline"], ch["time"]
    L.append(
        f"pipeline bubble (pp-1)/(vpp*m) = ({lo['pp']}-1)/({pl['vpp']}*{pl['num_microbatches']}) = "
        f"{pl['bubble_fraction']:.1%}"
    )
    L.append("communication per step, per GPU               volume        link        GB/s    time")
    for dim, x in ch["communication"].items():
        L.append(
            f"  {dim:<3} {x['what'][:40]:<40}{_vol(x['volume_bytes'])}  {x['link']:<10} {x['bandwidth_gbps']:6g}"
            f"  {x['time_s']:7.3f} s"
        )
    L.append(
        f"est. step {tm['step_s']:.2f} s = compute {tm['compute_s']:.2f} s (at {tm['assumed_mfu']:.0%} of peak)"
        f" + bubble {tm['bubble_s']:.2f} s + comm {tm['comm_s']:.2f} s (no overlap assumed)"
    )
    L.append("rank map: " + (", ".join(f"{k} {v}" for k, v in ch["rank_map"].items()) or "single GPU"))
    if doc["alternatives"]:
        L.append("")
        L.append("ALTERNATIVES (best variant of each other layout)")
        for a in doc["alternatives"]:
            al = a["layout"]
            L.append(
                f"  #{a['rank']} {a['overrides'].split(' parallel.sequence')[0]}  zero {al['zero_stage']} "
                f"{al['recompute']}  {a['memory']['total_bytes'] / M.GIB:.1f} GiB"
            )
            L.append(f"     lost: {a['why_lost']}")
    if doc.get("fewer_stages"):
        L.append("")
        L.append("WHY NOT FEWER PIPELINE STAGES")
        for f in doc["fewer_stages"]:
            L.append(f"  pp {f['pp']} ({f['describe']}): {f['why']}")
    if doc["ruled_out"]:
        L.append("")
        L.append("RULED OUT (pass the layout rules, do not fit)")
        for r in doc["ruled_out"]:
            L.append(f"  {r['describe']}: {r['why']}")
    s = doc["search"]
    L.append("")
    L.append(
        f"search: {s['candidates']:,} candidates, {s['valid']:,} pass the layout rules, {s['fitting']:,} fit "
        f"(with recompute variants); {s['seconds']:.2f} s"
    )
    return "\n".join(L)
