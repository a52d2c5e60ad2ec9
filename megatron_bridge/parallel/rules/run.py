"""One training run: batch arithmetic, schedules, ZeRO and the engine, evaluation, nodes."""

from __future__ import annotations

import importlib.util

from megatron_bridge.data.indexed import parse_split
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v
from megatron_bridge.parallel.rules.degrees import degrees_ok as _degrees_ok

RULES = RuleSet()


@RULES.run(reads=("layout", "run"))
def batch(f: Facts) -> list[Violation]:
    d, cfg = f.layout, f.run
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


@RULES.layout(reads=("layout",))
def interleaving(f: Facts) -> list[Violation]:
    d = f.layout
    if d.vpp is not None and d.vpp > 1 and d.pp < 2:
        return _v("vpp-pp", f"parallel.vpp={d.vpp} needs pp > 1 (pp={d.pp})", "set parallel.vpp=null or raise pp")
    return []


@RULES.run(reads=("layout",))
def microbatches(f: Facts) -> list[Violation]:
    d = f.layout
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


@RULES.run(reads=("layout", "run"))
def zero(f: Facts) -> list[Violation]:
    d, cfg = f.layout, f.run
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


@RULES.run(reads=("layout", "run"))
def deepspeed_engine(f: Facts) -> list[Violation]:
    d, cfg = f.layout, f.run
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


@RULES.run(reads=("run",))
def evaluation(f: Facts) -> list[Violation]:
    """Validation settings that would evaluate nothing, or a split that does not exist."""
    cfg = f.run
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
    if t.eval_iters > 0 and cfg.data.kind in ("indexed", "sft", "preference"):  # synthetic data always has one
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


@RULES.run(reads=("layout", "run"))
def sft_packing(f: Facts) -> list[Violation]:
    """Packed SFT samples use the THD (cumulative sequence lengths) attention path, which this
    version runs without context parallelism: CP would have to split every conversation."""
    d, cfg = f.layout, f.run
    if d.cp > 1 and cfg.data.kind == "sft" and cfg.data.packing:
        return _v(
            "sft-packing-cp",
            f"data.packing=true with parallel.cp={d.cp}: packed conversations are not split for context parallelism",
            "set data.packing=false (each conversation padded to train.seq_length; works with cp), or parallel.cp=1",
        )
    return []


@RULES.run(reads=("layout", "run"))
def node_placement(f: Facts) -> list[Violation]:
    d, cfg = f.layout, f.run
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


@RULES.run(reads=("run",))
def loggers(f: Facts) -> list[Violation]:
    """The logger group: a wandb mode wandb knows, and MLflow only where it is installed (the
    optional `mlflow` extra), refused before any process starts rather than at rank 0's first step."""
    lg = getattr(f.run, "logger", None)
    if lg is None:
        return []
    out = []
    if lg.wandb.enabled and lg.wandb.mode not in (None, "offline", "online", "disabled"):
        out += _v(
            "logger-wandb-mode",
            f"logger.wandb.mode={lg.wandb.mode!r} is not a wandb mode",
            "use logger.wandb.mode=offline, online or disabled (or null: $WANDB_MODE, else offline)",
        )
    if lg.mlflow.enabled and importlib.util.find_spec("mlflow") is None:
        out += _v(
            "logger-mlflow",
            "logger.mlflow.enabled=true but the mlflow package is not installed",
            "pip install 'mlflow-skinny==3.17.2' (or the project's extra: pip install -e '.[mlflow]'), "
            "or set logger.mlflow.enabled=false",
        )
    return out
