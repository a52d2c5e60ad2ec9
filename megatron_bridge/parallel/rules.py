"""Every rule a layout must satisfy, checked before any process group exists.

Each rule is a small function `(dims, cfg) -> list of Violation` named after what it
guards; `check_all` runs them all so the user sees every problem at once, not the first
assert megatron-core or DeepSpeed would hit twenty minutes into a launch. Messages name
the rule, the numbers, and a fix. docs/config.md lists the rules in the same order.

Two scopes. Layout rules (`@layout_rule`) decide whether the model can be built and split
under the degrees on the given processes: `mbr check`, `mbr plan`, training, `mbr convert`
and `mbr verify` all apply exactly these, so the five accept the same layouts. Run rules
(`@rule`) concern one training run only (batch arithmetic, schedules, ZeRO and engine, node
placement); a checkpoint conversion or a parity check has none of those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import lcm
from typing import Any

from megatron_bridge.parallel.dims import ParallelDims, padded_vocab_size


@dataclass(frozen=True)
class Violation:
    rule: str
    detail: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.detail}. Fix: {self.fix}."


Rule = Callable[[ParallelDims, Any], list[Violation]]
RULES: list[Rule] = []
LAYOUT_RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    """A run rule: checked by `mbr check`, `mbr plan` and training."""
    RULES.append(fn)
    return fn


def layout_rule(fn: Rule) -> Rule:
    """A layout rule: also checked by `mbr convert` and `mbr verify`."""
    LAYOUT_RULES.append(fn)
    return rule(fn)


def _v(rule_name: str, detail: str, fix: str) -> list[Violation]:
    return [Violation(rule_name, detail, fix)]


CHOICES = {
    "train.engine": ("megatron", "deepspeed"),
    "train.precision": ("auto", "fp32", "bf16"),
    "train.recompute": ("none", "selective", "full"),
    "cluster.backend": ("auto", "nccl", "gloo"),
    "zero.offload_optimizer": ("none", "cpu"),
    "zero.offload_param": ("none", "cpu"),
    "data.kind": ("synthetic", "indexed", "sft"),
    # engines.make_scheduler (megatron-core's scheduler; its WSD needs wsd_decay_steps, not exposed)
    "optimizer.decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
}


@rule
def choices(d, cfg):
    out = []
    for key, allowed in CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in allowed:
            out += _v("choice", f"{key}={value!r} is not one of {allowed}", f"set {key} to one of them")
    return out


@layout_rule
def positive_degrees(d, cfg):
    out = []
    for name in ("tp", "pp", "cp", "ep", "etp"):
        v = getattr(d, name)
        if v < 1:
            out += _v("positive-degree", f"parallel.{name}={v} must be >= 1", f"set parallel.{name} to 1 or more")
    if d.vpp is not None and d.vpp < 1:
        out += _v(
            "positive-degree", f"parallel.vpp={d.vpp} must be >= 1", "set parallel.vpp=null to disable interleaving"
        )
    for key in ("layers_first_stage", "layers_last_stage"):
        v = getattr(d, key)
        if v is not None and v < 1:
            out += _v("positive-degree", f"parallel.{key}={v} must be >= 1", f"set parallel.{key}=null or 1 or more")
    return out


@rule
def positive_sizes(d, cfg):
    out = []
    if not d.dp_inferred and d.dp < 1:
        out += _v("positive-degree", f"parallel.dp={d.dp} must be >= 1 or -1", "use parallel.dp=-1 to infer it")
    for key, v in (
        ("train.micro_batch_size", d.micro_batch_size),
        ("train.global_batch_size", d.global_batch_size),
        ("cluster.nodes", d.nodes if (d.world_size or 0) > 0 else 0),
        ("cluster.gpus_per_node", d.gpus_per_node),
    ):
        if v < 1:
            out += _v("positive-degree", f"{key}={v} must be >= 1", f"set {key} to 1 or more")
    if d.zero_stage not in (0, 1, 2, 3):
        out += _v("zero-stage", f"zero.stage={d.zero_stage} is not a ZeRO stage", "use zero.stage=0, 1, 2 or 3")
    return out


def _degrees_ok(d) -> bool:
    return min(d.tp, d.pp, d.cp, d.ep, d.etp) >= 1 and (d.world_size or 0) >= 1


@layout_rule
def world_size(d, cfg):
    if not _degrees_ok(d):
        return []
    mp = d.tp * d.pp * d.cp
    if d.dp_inferred:
        if d.world_size % mp:
            return _v(
                "world-size",
                f"tp·pp·cp = {d.tp}·{d.pp}·{d.cp} = {mp} does not divide the world size "
                f"{d.world_size}, so dp cannot be inferred",
                f"choose degrees whose product divides {d.world_size}, or change cluster.nodes/gpus_per_node",
            )
        return []
    if d.dp >= 1 and mp * d.dp != d.world_size:
        return _v(
            "world-size",
            f"tp·pp·cp·dp = {d.tp}·{d.pp}·{d.cp}·{d.dp} = {mp * d.dp} != world size "
            f"{d.world_size} (cluster.nodes·gpus_per_node or the launcher's WORLD_SIZE)",
            "set parallel.dp=-1 to infer it, or make the product equal the world size",
        )
    return []


@layout_rule
def attention_heads(d, cfg):
    m, out = cfg.model, []
    if d.tp >= 1 and m.num_attention_heads % d.tp:
        out += _v(
            "heads-tp",
            f"num_attention_heads={m.num_attention_heads} is not divisible by tp={d.tp}",
            "choose tp dividing the head count",
        )
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        out += _v(
            "hidden-heads",
            f"hidden_size={m.hidden_size} is not divisible by num_attention_heads={m.num_attention_heads}",
            "set model.kv_channels (head dim) explicitly",
        )
    kv = m.kv_heads
    if d.tp >= 1 and kv % d.tp and d.tp % kv:
        out += _v(
            "kv-heads-tp",
            f"num_query_groups (KV heads)={kv} and tp={d.tp}: neither divides the other; "
            "megatron-core shards whole KV groups (kv % tp == 0) or, with fewer KV heads than TP ranks, "
            "splits each group evenly (tp % kv == 0)",
            f"choose tp dividing {kv} or a multiple of it",
        )
    return out


@layout_rule
def pipeline_layers(d, cfg):
    p, n, v = d.pp, cfg.model.num_layers, d.vpp_or_1
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
    if problems:
        return _v(
            "layers-uneven",
            "uneven pipeline split of num_layers=" + f"{n} over pp={p}: " + "; ".join(problems),
            "adjust layers_first_stage/layers_last_stage (or pp, vpp)",
        )
    return []


@layout_rule
def sequence_length(d, cfg):
    s, out = cfg.train.seq_length, []
    if s < 1:
        return _v("seq-length", f"train.seq_length={s} must be >= 1", "set a positive sequence length")
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


@layout_rule
def experts(d, cfg):
    e = cfg.model.num_moe_experts
    if d.ep > 1 and not e:
        return _v(
            "ep-dense",
            f"parallel.ep={d.ep} but model {cfg.model.name} has no experts",
            "set parallel.ep=1 for a dense model",
        )
    if e and d.ep >= 1 and e % d.ep:
        return _v(
            "experts-ep", f"num_moe_experts={e} is not divisible by ep={d.ep}", "choose ep dividing the expert count"
        )
    return []


@rule
def moe_tp_sp(d, cfg):
    # parallel.sequence_parallel=null (auto) turns SP on here; only a pinned false gets this far.
    # A run rule: the weights' layout does not depend on SP, and forward-only use (mbr verify's
    # logits) works without it; training is what megatron-core refuses.
    if d.sequence_parallel_required(bool(cfg.model.num_moe_experts), d.tp) and not d.sequence_parallel:
        return _v(
            "moe-tp-sp",
            f"MoE with tp={d.tp} needs sequence parallelism, but parallel.sequence_parallel=false is "
            "pinned: megatron-core's MoE layer refuses to train with TP but without SP (the expert "
            "weight gradients would come out wrong)",
            "drop the pin (auto turns it on for MoE with TP), or set parallel.sequence_parallel=true",
        )
    return []


@layout_rule
def expert_grid(d, cfg):
    if not _degrees_ok(d) or not cfg.model.num_moe_experts:
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


@rule
def batch(d, cfg):
    if d.dp < 1 or d.micro_batch_size < 1 or d.global_batch_size < 1:
        return []
    per_step = d.micro_batch_size * d.dp
    if cfg.train.grad_accum is None and d.global_batch_size % per_step:
        return _v(
            "global-batch",
            f"global_batch_size={d.global_batch_size} is not divisible by "
            f"micro_batch_size·dp = {d.micro_batch_size}·{d.dp} = {per_step}",
            f"use a global batch that is a multiple of {per_step}",
        )
    if d.global_batch_size != per_step * d.grad_accum:
        return _v(
            "global-batch",
            f"global_batch_size={d.global_batch_size} != micro·grad_accum·dp = "
            f"{d.micro_batch_size}·{d.grad_accum}·{d.dp} = {per_step * d.grad_accum}",
            "set train.grad_accum=null to infer it, or fix the numbers",
        )
    return []


@layout_rule
def interleaving(d, cfg):
    if d.vpp is not None and d.vpp > 1 and d.pp < 2:
        return _v("vpp-pp", f"parallel.vpp={d.vpp} needs pp > 1 (pp={d.pp})", "set parallel.vpp=null or raise pp")
    return []


@rule
def microbatches(d, cfg):
    out, m = [], d.grad_accum
    if d.pp > 1 and 0 < m < d.pp:
        out += _v(
            "microbatches-pp",
            f"{m} microbatch(es) per step < pp={d.pp}: the pipeline never fills",
            f"raise train.global_batch_size to at least {d.pp * d.micro_batch_size * max(d.dp, 1)}",
        )
    if d.vpp is not None and d.vpp > 1 and d.pp > 1:
        if m % d.pp:
            out += _v(
                "vpp-microbatches",
                f"interleaved 1F1B needs microbatches % pp == 0 ({m} % {d.pp} != 0)",
                f"make global_batch/(micro·dp) a multiple of {d.pp}",
            )
    return out


@rule
def zero(d, cfg):
    out = []
    if d.zero_stage >= 2 and d.pp > 1:
        out += _v(
            "zero-pp",
            f"zero.stage={d.zero_stage} with pp={d.pp}: DeepSpeed's pipeline engine asserts "
            "ZeRO stage < 2 (gradients/params sharded over DP fight the pipeline's per-microbatch "
            "accumulation)",
            "use zero.stage=1 with pipeline parallelism, or pp=1",
        )
    if d.zero_stage >= 2 and cfg.train.engine == "megatron":
        out += _v(
            "zero-engine",
            f"zero.stage={d.zero_stage} needs train.engine=deepspeed; megatron-core's DistributedOptimizer is ZeRO-1",
            "add train.engine=deepspeed, or use zero.stage=1",
        )
    if cfg.zero.offload_param != "none" and d.zero_stage != 3:
        out += _v("zero-offload", "zero.offload_param needs zero.stage=3", "set zero.stage=3 or offload_param=none")
    return out


@rule
def deepspeed_engine(d, cfg):
    if cfg.train.engine != "deepspeed":
        return []
    bad = [f"{k}={v}" for k, v in (("pp", d.pp), ("cp", d.cp), ("ep", d.ep)) if v > 1]
    if d.sequence_parallel:
        bad.append("sequence_parallel=true")
    if bad:
        return _v(
            "deepspeed-engine",
            f"train.engine=deepspeed runs ZeRO data parallelism (with TP) only; "
            f"{', '.join(bad)} needs megatron-core's schedules and gradient reductions",
            "use train.engine=megatron (zero.stage=1 = its distributed optimizer) for PP/CP/EP/SP",
        )
    return []


@rule
def evaluation(d, cfg):
    """Validation settings that would evaluate nothing, or a split that does not exist."""
    t, out = cfg.train, []
    for key, v in (("train.eval_interval", t.eval_interval), ("train.eval_iters", t.eval_iters)):
        if v < 0:
            out += _v("eval-iters", f"{key}={v} must be >= 0", f"set {key}=0 (off) or a positive count")
    if t.eval_interval > 0 and t.eval_iters == 0:
        out += _v(
            "eval-iters",
            f"train.eval_interval={t.eval_interval} evaluates nothing: train.eval_iters=0 batches per evaluation",
            "set train.eval_iters=K (global batches of the valid split per evaluation), or train.eval_interval=0",
        )
    if t.eval_iters > 0 and cfg.data.kind in ("indexed", "sft"):  # synthetic data always has a valid split
        from megatron_bridge.data.indexed import parse_split
        from megatron_bridge.errors import UserError

        try:
            valid = parse_split(cfg.data.split)[1]
        except UserError:  # a malformed split is the data check's to report (preflight)
            return out
        if valid == 0:
            out += _v(
                "eval-split",
                f"train.eval_iters={t.eval_iters} evaluates the valid split, but data.split={cfg.data.split!r} "
                "gives it no weight",
                "give the valid split a share (e.g. data.split=98/2/0), or set train.eval_iters=0",
            )
    return out


@rule
def sft_packing(d, cfg):
    """Packed SFT samples use the THD (cumulative sequence lengths) attention path, which this
    version runs without context parallelism: CP would have to split every conversation."""
    if d.cp > 1 and cfg.data.kind == "sft" and cfg.data.packing:
        return _v(
            "sft-packing-cp",
            f"data.packing=true with parallel.cp={d.cp}: packed conversations are not split for context parallelism",
            "set data.packing=false (each conversation padded to train.seq_length; works with cp), or parallel.cp=1",
        )
    return []


@rule
def node_placement(d, cfg):
    if d.gpus_per_node < 1 or not _degrees_ok(d) or cfg.parallel.allow_cross_node_tp:
        return []
    out = []
    if d.gpus_per_node % d.tp:
        out += _v(
            "tp-in-node",
            f"tp={d.tp} does not fit evenly in a node of {d.gpus_per_node} GPUs, so TP "
            "groups (the chattiest traffic, every layer) would cross the inter-node network",
            f"use tp dividing {d.gpus_per_node}, or parallel.allow_cross_node_tp=true to accept it",
        )
    elif d.cp > 1 and d.gpus_per_node % (d.tp * d.cp):
        out += _v(
            "cp-in-node",
            f"tp·cp = {d.tp * d.cp} does not fit evenly in a node of {d.gpus_per_node} GPUs, "
            "so CP groups would cross nodes",
            "lower cp, or parallel.allow_cross_node_tp=true to accept it",
        )
    return out


# The model rules live in model_rules.py; importing it registers them (after the degree rules).
from megatron_bridge.parallel import model_rules  # noqa: E402, F401


def notes(d: ParallelDims, cfg) -> list[str]:
    """Non-fatal findings, printed with the rank map."""
    m, out = cfg.model, []
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, max(d.tp, 1))
    if padded != m.vocab_size:
        out.append(
            f"vocab {m.vocab_size} padded to {padded} (multiple of make_vocab_size_divisible_by·tp = "
            f"{m.make_vocab_size_divisible_by}·{d.tp})"
        )
    if d.tp > m.kv_heads:
        out.append(
            f"KV heads ({m.kv_heads}) < tp ({d.tp}): each TP rank holds part of one KV group; "
            "megatron-core gathers the K/V activations"
        )
    if cfg.parallel.sequence_parallel is None and d.sequence_parallel:
        out.append(
            f"sequence_parallel turned on automatically: MoE with tp={d.tp} needs it (megatron-core refuses "
            "to train MoE with TP otherwise); pin parallel.sequence_parallel=true to say so explicitly"
        )
    if d.sequence_parallel and d.tp == 1:
        out.append("sequence_parallel has no effect at tp=1 (megatron disables it)")
    if cfg.parallel.allow_cross_node_tp and (d.gpus_per_node or 1) % max(d.tp * d.cp, 1):
        out.append("warning: TP/CP groups cross node boundaries (allowed by parallel.allow_cross_node_tp)")
    return out + values.notes(cfg)


def check_all(d: ParallelDims, cfg, *, layout_only: bool = False) -> tuple[list[Violation], list[str]]:
    """Every rule (or only the layout rules), and the notes when nothing is violated."""
    import megatron_bridge.bridge.lora  # noqa: F401 - registers the LoRA rules (peft=lora)

    violations: list[Violation] = []
    for r in LAYOUT_RULES if layout_only else RULES:
        violations += r(d, cfg)
    return violations, (notes(d, cfg) if not violations else [])


# Optimizer/schedule/interval rules live in config/values.py; importing it registers them (after
# the layout rules, so messages list layout problems first).
from megatron_bridge.config import values  # noqa: E402
