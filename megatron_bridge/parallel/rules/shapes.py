"""The model under the degrees: heads, layers, sequence and experts split evenly."""

from __future__ import annotations

from math import lcm

from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v
from megatron_bridge.parallel.rules.degrees import degrees_ok as _degrees_ok

RULES = RuleSet()
MAX_SEQ_LENGTH = 1 << 24  # tokens per sample: 16M, above the longest contexts trained today (~10M)


@RULES.layout(reads=("layout", "model"))
def attention_heads(f: Facts) -> list[Violation]:
    d, m = f.layout, f.model
    out = []
    if d.tp >= 1 and m.num_attention_heads % d.tp:
        out += _v(
            "heads-tp",
            f"num_attention_heads={m.num_attention_heads} is not divisible by tp={d.tp}",
            "choose tp dividing the head count",
        )
    kv = m.num_query_groups
    if d.tp >= 1 and kv % d.tp and d.tp % kv:
        out += _v(
            "kv-heads-tp",
            f"num_query_groups (KV heads)={kv} and tp={d.tp}: neither divides the other; "
            "megatron-core shards whole KV groups (kv % tp == 0) or, with fewer KV heads than TP ranks, "
            "splits each group evenly (tp % kv == 0)",
            f"choose tp dividing {kv} or a multiple of it",
        )
    return out


@RULES.layout(reads=("layout", "model"))
def pipeline_layers(f: Facts) -> list[Violation]:
    d, m = f.layout, f.model
    p, n, v = d.pp, m.num_layers, d.vpp_or_1
    if p < 1 or v < 1:
        return []
    first, last = d.layers_first_stage, d.layers_last_stage
    if first is None and last is None:
        if n % (p * v):
            return _v(
                "layers-pp",
                f"num_layers={n} is not divisible by pp·vpp = {p}·{v} = {p * v}",
                "choose pp·vpp dividing the layer count, or set parallel.layers_first_stage/"
                "layers_last_stage for an uneven split",
            )
        return []
    # megatron-core's TransformerConfig checks, said up front: the end stages hold a
    # multiple of vpp layers each, and the middle stages (if any) split the rest evenly
    # into a multiple of vpp layers per rank.
    fixed = [x for x in (first, last) if x is not None]
    rest, stages = n - sum(fixed), p - len(fixed)
    problems = []
    if stages < 0:
        problems.append(f"layers_first_stage and layers_last_stage need pp >= 2 (pp={p})")
    if min(fixed) < 1 or any(x % v for x in fixed):
        problems.append(f"the first/last stages' layers ({first}/{last}) must each be >= 1 and a multiple of vpp={v}")
    if stages > 0 and (rest < stages * v or rest % (stages * v)):
        problems.append(
            f"the remaining {rest} layers must split evenly over the {stages} middle stage(s), "
            f"a multiple of vpp={v} layers each"
        )
    if stages == 0 and rest != 0:
        problems.append(f"{rest} layers are left over but there is no middle stage (pp={p})")
    if stages == 0 and v > 1:  # megatron-core 0.16 divides by the middle stages' count
        problems.append(
            f"with vpp={v}, megatron-core needs a middle stage when both end stages are fixed (pp={p} leaves none)"
        )
    if problems:
        return _v(
            "layers-uneven",
            "uneven pipeline split of num_layers=" + f"{n} over pp={p}: " + "; ".join(problems),
            "adjust layers_first_stage/layers_last_stage (or pp, vpp)",
        )
    return []


@RULES.layout(reads=("layout", "run"))
def sequence_length(f: Facts) -> list[Violation]:
    d, cfg = f.layout, f.run
    s, out = cfg.train.seq_length, []
    if s < 1:
        return _v("seq-length", f"train.seq_length={s} must be >= 1", "set a positive sequence length")
    if s > MAX_SEQ_LENGTH:
        return _v(
            "seq-length",
            f"train.seq_length={s} is more than {MAX_SEQ_LENGTH} tokens per sample, beyond what any model attends "
            "over (its activations alone would not fit any machine)",
            "set the sequence length the model is trained for (model.max_position_embeddings or less)",
        )
    if d.cp > 1 and s % (2 * d.cp):
        out += _v(
            "seq-cp",
            f"seq_length={s} is not divisible by 2·cp = {2 * d.cp}; context parallelism splits "
            "the sequence into 2·cp load-balanced chunks",
            f"use a multiple of {2 * d.cp}",
        )
    if d.sequence_parallel and d.tp >= 1 and s % (d.tp * d.cp):
        m = lcm(d.tp * d.cp, 2 * d.cp if d.cp > 1 else 1)
        out += _v(
            "seq-sp",
            f"sequence parallelism shards each rank's seq_length/cp = {s}/{d.cp} over tp={d.tp}, which does not divide",
            f"use a seq_length that is a multiple of {m}",
        )
    return out


@RULES.layout(reads=("layout", "model"))
def experts(f: Facts) -> list[Violation]:
    d, m = f.layout, f.model
    e = m.num_moe_experts
    if d.ep > 1 and not e:
        return _v(
            "ep-dense",
            f"parallel.ep={d.ep} but model {m.name} has no experts",
            "set parallel.ep=1 for a dense model",
        )
    if e and d.ep >= 1 and e % d.ep:
        return _v(
            "experts-ep", f"num_moe_experts={e} is not divisible by ep={d.ep}", "choose ep dividing the expert count"
        )
    return []


@RULES.run(reads=("layout", "model"))
def moe_tp_sp(f: Facts) -> list[Violation]:
    d, m = f.layout, f.model
    # parallel.sequence_parallel=null (auto) turns SP on here; only a pinned false gets this far.
    # A run rule: the weights' layout does not depend on SP, and forward-only use (mbr verify's
    # logits) works without it; training is what megatron-core refuses.
    if d.sequence_parallel_required(bool(m.num_moe_experts), d.tp) and not d.sequence_parallel:
        return _v(
            "moe-tp-sp",
            f"MoE with tp={d.tp} needs sequence parallelism, but parallel.sequence_parallel=false is "
            "pinned: megatron-core's MoE layer refuses to train with TP but without SP (the expert "
            "weight gradients would come out wrong)",
            "drop the pin (auto turns it on for MoE with TP), or set parallel.sequence_parallel=true",
        )
    return []


@RULES.layout(reads=("layout", "model"))
def expert_grid(f: Facts) -> list[Violation]:
    d, m = f.layout, f.model
    if not _degrees_ok(d) or not m.num_moe_experts:
        return []
    grid = d.etp * d.ep * d.pp
    if d.world_size % grid:
        return _v(
            "expert-grid",
            f"megatron-core's parallel_state lays experts out as etp·ep·expert_dp·pp over the "
            f"same ranks, so etp·ep·pp = {d.etp}·{d.ep}·{d.pp} = {grid} must divide the world size "
            f"{d.world_size} (equivalently etp·ep must divide tp·cp·dp)",
            "lower ep or etp (etp defaults to tp), or add ranks",
        )
    return []
