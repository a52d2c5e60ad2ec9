"""Communication per training step, per dimension, priced at the link each group spans.

Why per dimension and per link: the decision framework's first rule (docs/plan.md) is
"map the chattiest parallelism to the fastest links". So for each group (tp, cp, ep, pp, dp) the planner
states the bytes one GPU sends per step and divides by the bandwidth of the link that
group actually crosses: `cluster.intra_node_bandwidth_gbps` when every group of that kind
stays inside a node (NVLink), `inter_node_bandwidth_gbps` otherwise (InfiniBand). Whether
a group stays inside a node comes from the rank grid (megatron-core's order tp-cp-ep-dp-pp,
as `parallel.topology.Topology`), computed arithmetically in `group_spans` so that a
16,384-rank search stays fast; a test checks it equals `Topology.span_summary`.

Volumes (bytes sent per GPU; ring collectives: all-reduce 2(n−1)/n·size, reduce-scatter
and all-gather (n−1)/n·size each):
  TP   per layer and microbatch 2 all-reduces forward + 2 backward of the s·b·h activation
       (with SP the same volume as reduce-scatter + all-gather); full recompute adds the
       forward's 2 again.
  PP   per microbatch and model chunk, one activation forward and one gradient backward
       across each stage boundary (s·b·h/t: with SP megatron sends the sequence shard,
       without it the scatter/gather optimisation of Narayanan et al. 2021 splits the
       message over the t ranks and all-gathers it on NVLink).
  DP   once per step: ZeRO-0 all-reduces the gradients; ZeRO-1/2 reduce-scatter gradients
       and all-gather updated weights (same volume); ZeRO-3 all-gathers weights twice
       (forward and backward) — over dp·cp for dense and expert-dp for expert parameters.
  CP   ring attention: each layer passes the K/V shard (cp−1) times forward; backward
       passes K/V again plus dK/dV (3× the forward volume in all).
  EP   per MoE layer and microbatch, 4 all-to-alls (dispatch and combine, forward and
       backward) of the rank's top-k token copies, (ep−1)/ep of which leave the GPU.
Overlap: every volume above is counted as exposed (on the critical path). TP, CP and EP
sit between dependent GEMMs; PP sends sit at the stage boundaries of the schedule; the DP
reduction ran after the pipeline flush in the published runs the model is checked against
(plan/published.py), so it is exposed too. Compute runs at `cluster.achieved_efficiency` of
peak, `ACHIEVED_EFFICIENCY` unless set: fitted once, to Narayanan et al. 2021 Table 1.
"""

from __future__ import annotations

import numpy as np

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.plan.params import attention_widths

# Fraction of peak the GEMMs of a training step achieve (recompute, bubble and exposed
# communication priced separately). One number, fitted to the ten published runs of
# plan/published.py (benchmarks/plan_published.py prints the fit); clusters override it
# with `cluster.achieved_efficiency`, e.g. from the GPU kit's measured MFU.
ACHIEVED_EFFICIENCY = 0.53


def _intra(stride: int, n: int, gpn: int, world: int) -> bool:
    """True when every group {base + k·stride : k < n} of the grid lies within one node."""
    if n <= 1 or gpn % (stride * n) == 0:
        return True
    if stride % gpn == 0:
        return False
    span = stride * n
    base = (np.arange(world // span)[:, None] * span + np.arange(stride)[None, :]).ravel()
    return bool(((base // gpn) == ((base + (n - 1) * stride) // gpn)).all())


def group_spans(*, tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, gpn: int) -> dict[str, bool]:
    """{group: stays inside a node} for the groups the planner prices, from the grid
    order tp-cp-ep-dp-pp (dense grid: ep=1; expert grid: etp, ep, expert-dp, pp)."""
    world = tp * cp * dp * pp
    edp = world // (etp * ep * pp)
    return {
        "tp": _intra(1, tp, gpn, world),
        "cp": _intra(tp, cp, gpn, world),
        "dp": _intra(tp * cp, dp, gpn, world),
        "dp_cp": _intra(tp, cp * dp, gpn, world),
        "pp": _intra(tp * cp * dp, pp, gpn, world),
        "ep": _intra(etp, ep, gpn, world),
        "edp": _intra(etp * ep, edp, gpn, world),
    }


def _ring_ar(n: int, size: float) -> float:
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def _ring_half(n: int, size: float) -> float:
    return (n - 1) / n * size if n > 1 else 0.0


def step_comm(
    m,
    *,
    tp: int,
    cp: int,
    dp: int,
    pp: int,
    ep: int,
    etp: int,
    edp: int,
    vpp: int,
    sp: bool,
    zero: int,
    recompute: str,
    s: int,
    b: int,
    num_micro: int,
    layers: int,
    dense_params: float,
    expert_params: float,
    spans: dict[str, bool],
    intra_gbps: float,
    inter_gbps: float,
    act_bytes: int = 2,
    grad_bytes: int = 2,
    weight_bytes: int = 2,
) -> dict[str, dict]:
    """Per-dimension {volume_bytes, link, bandwidth_gbps, time_s} for one training step
    on one GPU of a stage with `layers` layers and `dense_params`/`expert_params`."""
    h = m.hidden_size
    seq = s / cp
    act = seq * b * h * act_bytes
    full = recompute == "full"
    moe = bool(m.num_moe_experts)
    out: dict[str, dict] = {}

    def put(name: str, volume: float, span_key: str, what: str) -> None:
        intra = spans.get(span_key, True)
        bw = intra_gbps if intra else inter_gbps
        out[name] = {
            "volume_bytes": volume,
            "link": "intra-node" if intra else "inter-node",
            "bandwidth_gbps": bw,
            "time_s": volume / (bw * 1e9) if volume else 0.0,
            "what": what,
        }

    if tp > 1:
        per_layer = (4 + (2 if full else 0)) * _ring_ar(tp, act)
        what = "reduce-scatter+all-gather per layer" if sp else "all-reduce per layer"
        put("tp", per_layer * layers * num_micro, "tp", what)
    if pp > 1:
        msg = act / tp  # SP sends the sequence shard; without SP megatron's scatter/gather does the same
        put("pp", 2 * num_micro * max(vpp, 1) * msg, "pp", "p2p send/recv per microbatch")
    n_dp = dp * cp
    if n_dp > 1 or (moe and edp > 1):

        def dp_volume(params: float, n: int) -> float:
            if zero == 0:
                return _ring_ar(n, params * grad_bytes)
            gathers = 2 if zero >= 3 else 1
            return _ring_half(n, params * grad_bytes) + gathers * _ring_half(n, params * weight_bytes)

        what = (
            "all-reduce grads"
            if zero == 0
            else ("reduce-scatter grads, all-gather params" + (" x2" if zero >= 3 else ""))
        )
        put("dp", dp_volume(dense_params, n_dp), "dp_cp", what)
        if moe and expert_params:
            dense = out.pop("dp")
            put("dp", dp_volume(expert_params, edp), "edp", what)
            exp = out["dp"]
            inter = "inter-node" in (dense["link"], exp["link"])
            exp.update(
                volume_bytes=dense["volume_bytes"] + exp["volume_bytes"],
                time_s=dense["time_s"] + exp["time_s"],
                link="inter-node" if inter else "intra-node",
                bandwidth_gbps=inter_gbps if inter else intra_gbps,
            )
    if cp > 1:
        _, k_width, v_width = attention_widths(m)  # MLA: the up-projected heads, not the latent
        kv = seq * b * (k_width + v_width) * act_bytes / tp
        per_layer = (3 + (1 if full else 0)) * (cp - 1) * kv
        put("cp", per_layer * layers * num_micro, "cp", "ring K/V exchange per layer")
    if moe and ep > 1:
        tokens = seq * b * min(m.moe_router_topk, m.num_moe_experts) / (tp if sp else 1)
        per_layer = (4 + (2 if full else 0)) * (ep - 1) / ep * tokens * h * act_bytes
        moe_share = backend_of(m).shards(m).moe_layers() / m.num_layers  # dense-first layers have no all-to-all
        put("ep", per_layer * layers * moe_share * num_micro, "ep", "all-to-all per MoE layer")
    return out


def bubble_fraction(pp: int, vpp: int, num_micro: int) -> float:
    """Pipeline bubble relative to the ideal compute time: (p−1)/(v·m)."""
    if pp <= 1 or num_micro < 1:
        return 0.0
    return (pp - 1) / (max(vpp, 1) * num_micro)


def vision_flops(m, *, patches: int) -> float:
    """Forward FLOPs of a VLM's vision pieces on one image of `patches` patches: 2·params per
    patch (the projector counted per patch too, before any patch merge) plus the attention core,
    every patch attending to every patch of its image in each layer (4·patches²·width·depth;
    windowed layers attend to fewer)."""
    return 2 * m.vision_params * patches + 4 * patches * patches * m.vision_width


def step_flops(
    m, count, *, s: int, global_batch: int, recompute: str, images: int = 1, patches: int | None = None
) -> float:
    """Model FLOPs of one step (forward + backward = 3× forward; recompute adds forward
    work: all of it for full, the attention core for selective). A VLM's vision pieces:
    `images` per sample of `patches` patches each (default: the vision config's fixed size),
    `vision_flops` each, forward and backward (no recompute: they run whole, once)."""
    L = m.num_layers
    q_width, _, v_width = attention_widths(m)
    attn_core = 2 * s * (q_width + v_width) * L  # QK^T and ·V per token
    # layers + logits (the vision pieces, in count.active, run per patch below, not per token)
    matmul = 2 * (count.active - count.embedding - m.vision_params + m.vocab_size * m.hidden_size)
    fwd = matmul + attn_core
    extra = {"none": 0.0, "selective": attn_core, "full": fwd}[recompute]
    vision = 3 * images * vision_flops(m, patches=m.vision_patches if patches is None else patches)
    return global_batch * (s * (3 * fwd + extra) + vision)


def compute_seconds(flops: float, world: int, peak_tflops: float, efficiency: float | None = None) -> float:
    return flops / (world * peak_tflops * 1e12 * (efficiency or ACHIEVED_EFFICIENCY))
