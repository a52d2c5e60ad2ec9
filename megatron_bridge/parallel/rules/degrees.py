"""The degrees themselves: known choices, positive sizes, and a world size they fill."""

from __future__ import annotations

from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v

RULES = RuleSet()

CHOICES = {
    "train.engine": ("megatron", "deepspeed"),
    "train.precision": ("auto", "fp32", "bf16", "fp8"),  # fp8: where it can run (values.fp8_training)
    "train.fp8_recipe": ("tensorwise", "rowwise"),  # runtime/fp8.py RECIPES
    "train.recompute": ("none", "selective", "full"),
    "train.on_nonfinite": ("stop", "skip"),
    "checkpoint.resume": (False, True, "auto"),
    "cluster.backend": ("auto", "nccl", "gloo"),
    "zero.offload_optimizer": ("none", "cpu"),
    "zero.offload_param": ("none", "cpu"),
    "data.kind": ("synthetic", "indexed", "sft", "preference"),
    # engines.make_scheduler (megatron-core's scheduler; its WSD needs wsd_decay_steps, not exposed)
    "optimizer.decay_style": ("constant", "linear", "cosine", "inverse-square-root"),
    "objective.kind": ("lm", "dpo", "distill"),
    "objective.loss": ("sigmoid", "ipo", "hinge", "simpo"),  # TRL's DPO losses of those names
    "objective.divergence": ("forward_kl", "reverse_kl", "jsd"),  # runtime/vocab_parallel.py
}


def degrees_ok(d) -> bool:
    """Every degree >= 1 and a world: the arithmetic of the other rules is defined."""
    return min(d.tp, d.pp, d.cp, d.ep, d.etp) >= 1 and (d.world_size or 0) >= 1


@RULES.run(reads=("run",))
def choices(f: Facts) -> list[Violation]:
    cfg = f.run
    out = []
    for key, allowed in CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in allowed:
            out += _v("choice", f"{key}={value!r} is not one of {allowed}", f"set {key} to one of them")
    return out


@RULES.layout(reads=("layout",))
def positive_degrees(f: Facts) -> list[Violation]:
    d = f.layout
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


@RULES.run(reads=("layout",))
def positive_sizes(f: Facts) -> list[Violation]:
    d = f.layout
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


@RULES.layout(reads=("layout",))
def world_size(f: Facts) -> list[Violation]:
    d = f.layout
    if not degrees_ok(d):
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
