"""Optimizer, schedule and training values, refused like layouts.

A negative learning rate, a warmup longer than the run or a `log_interval` of 0 is as much a
broken launch as an indivisible world size: megatron-core would accept most of them and
train something meaningless (or divide by zero at the first log line) minutes later. These
rules read no layout, so `mbr plan` checks them once before its search (`registry.refuse`).
The choice of `optimizer.decay_style` is checked with the other choices (`degrees.CHOICES`).

`notes` adds the non-fatal finding: a rotary model trained past its `max_position_embeddings`,
naming the rope scaling in force (learned absolute positions, the GPT family, have no row
past it: that is the `seq-positions` error).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron_bridge.parallel.rules.base import Facts, RuleSet, Violation
from megatron_bridge.parallel.rules.base import violation as _v
from megatron_bridge.plan.params import learned_positions as _position_rows

RULES = RuleSet()


def _nonfinite(obj: Any, prefix: str = "") -> list[str]:
    """`key=value` of every float field of the recipe (any group) that is NaN or infinite."""
    out = []
    for fd in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else ():
        v = getattr(obj, fd.name)
        if dataclasses.is_dataclass(v):
            out += _nonfinite(v, f"{prefix}{fd.name}.")
        elif isinstance(v, float) and not math.isfinite(v):
            out.append(f"{prefix}{fd.name}={v}")
    return out


@RULES.run(reads=("run",))
def finite_values(f: Facts) -> list[Violation]:
    """No NaN or infinity anywhere in the recipe: `optimizer.lr=inf` would pass `lr > 0` and train
    NaN from the first step; the numerics settings themselves are checked here too."""
    bad, out = _nonfinite(f.run), []
    if bad:
        out += _v(
            "finite-value",
            f"{', '.join(bad)}: a setting must be a finite number (NaN and infinity are refused)",
            "give each a finite value, or drop the override to keep the recipe's",
        )
    t = f.run.train
    if t.max_skipped_steps < 1:
        out += _v(
            "max-skipped-steps",
            f"train.max_skipped_steps={t.max_skipped_steps} must be >= 1 (train.on_nonfinite=skip stops the job "
            "after that many non-finite steps in a row)",
            "set train.max_skipped_steps=5, or train.on_nonfinite=stop to end at the first one",
        )
    return out


@RULES.run(reads=("run",))
def learning_rate(f: Facts) -> list[Violation]:
    cfg = f.run
    o, out = cfg.optimizer, []
    if not o.lr > 0:
        out += _v(
            "lr", f"optimizer.lr={o.lr:g} must be > 0", "set a positive peak learning rate, e.g. optimizer.lr=3e-4"
        )
    if o.min_lr < 0 or (o.lr > 0 and o.min_lr > o.lr):
        out += _v(
            "min-lr",
            f"optimizer.min_lr={o.min_lr:g} must lie in [0, optimizer.lr={o.lr:g}]: the schedule decays from lr "
            "down to min_lr",
            "set optimizer.min_lr to at most optimizer.lr (e.g. lr/10), or 0",
        )
    return out


@RULES.run(reads=("run",))
def adam(f: Facts) -> list[Violation]:
    cfg = f.run
    o, out = cfg.optimizer, []
    if o.weight_decay < 0:
        out += _v(
            "weight-decay",
            f"optimizer.weight_decay={o.weight_decay:g} must be >= 0 (a negative decay grows the weights)",
            "set optimizer.weight_decay to 0 or a small positive value such as 0.01",
        )
    for key in ("adam_beta1", "adam_beta2"):
        b = getattr(o, key)
        if not 0 <= b < 1:
            out += _v(
                "adam-betas",
                f"optimizer.{key}={b:g} must lie in [0, 1): it is the decay of Adam's moving average",
                f"set optimizer.{key} below 1 (0.9 for beta1, 0.95-0.999 for beta2)",
            )
    if not o.adam_eps > 0:
        out += _v(
            "adam-eps",
            f"optimizer.adam_eps={o.adam_eps:g} must be > 0 (it keeps Adam's update finite)",
            "set optimizer.adam_eps=1e-8",
        )
    if o.clip_grad < 0:
        out += _v(
            "clip-grad",
            f"optimizer.clip_grad={o.clip_grad:g} must be >= 0 (the gradient-norm bound; 0 = no clipping)",
            "set optimizer.clip_grad=1.0, or 0 to disable clipping",
        )
    return out


@RULES.run(reads=("run",))
def schedule(f: Facts) -> list[Violation]:
    cfg = f.run
    o, t, out = cfg.optimizer, cfg.train, []
    if t.steps <= 0:
        out += _v("train-steps", f"train.steps={t.steps} must be >= 1", "set the number of optimizer steps to train")
    if o.warmup_steps < 0 or (t.steps > 0 and o.warmup_steps > t.steps):
        out += _v(
            "warmup-steps",
            f"optimizer.warmup_steps={o.warmup_steps} must lie in [0, train.steps={t.steps}]: a warmup longer "
            "than the run never reaches optimizer.lr",
            f"set optimizer.warmup_steps to at most {max(t.steps, 0)} (a few percent of train.steps is usual)",
        )
    return out


@RULES.run(reads=("run",))
def intervals(f: Facts) -> list[Violation]:
    cfg = f.run
    # train.eval_interval / eval_iters are checked with the data they read (rules/run.py).
    out = []
    if cfg.train.log_interval < 1:
        out += _v(
            "interval",
            f"train.log_interval={cfg.train.log_interval} must be >= 1 (log every N steps)",
            "set train.log_interval=1 to log every step",
        )
    if cfg.train.export_interval < 0:
        out += _v(
            "interval",
            f"train.export_interval={cfg.train.export_interval} must be >= 0 (an HF export every N steps; 0 = none)",
            "set train.export_interval=0 to export only at the end (export_to=DIR)",
        )
    if cfg.train.export_buffer_bytes < 0:
        out += _v(
            "interval",
            f"train.export_buffer_bytes={cfg.train.export_buffer_bytes} must be >= 0 (host bytes queued for the "
            "background HF export writer; 0 = the interval export is written in the step)",
            "set train.export_buffer_bytes=0, or a size such as 1073741824 (1 GiB)",
        )
    if cfg.train.straggler_interval < 0:
        out += _v(
            "interval",
            f"train.straggler_interval={cfg.train.straggler_interval} must be >= 0 (compare the ranks' step "
            "times every N steps; 0 = off)",
            "set train.straggler_interval=0 to turn straggler detection off, or e.g. 100",
        )
    if cfg.train.loss_chunk < 0 or cfg.train.loss_chunk > cfg.train.seq_length:
        out += _v(
            "loss-chunk",
            f"train.loss_chunk={cfg.train.loss_chunk} must lie in [0, train.seq_length={cfg.train.seq_length}] "
            "(sequence positions per piece of the LM head and its cross entropy; 0 = all at once)",
            "set train.loss_chunk=0, or a divisor-sized piece such as 1024",
        )
    if not cfg.train.straggler_factor > 1:
        out += _v(
            "straggler-factor",
            f"train.straggler_factor={cfg.train.straggler_factor:g} must be > 1 (a rank is named when its compute "
            "time is that many times its peers' median)",
            "set train.straggler_factor=1.5",
        )
    ck = cfg.checkpoint
    if ck.save_interval < 0:
        out += _v(
            "interval",
            f"checkpoint.save_interval={ck.save_interval} must be >= 0 (save every N steps; 0 = only at the end)",
            "set checkpoint.save_interval=0 to save only at the end",
        )
    if ck.lease_stale_s <= 0:
        out += _v(
            "interval",
            f"checkpoint.lease_stale_s={ck.lease_stale_s:g} must be > 0 (seconds without refresh before another "
            "host may take the directory over)",
            "leave it at 60, or raise it on a slow shared filesystem",
        )
    return out


@RULES.run(reads=("model", "run"))
def positions(f: Facts) -> list[Violation]:
    m, s = f.model, f.run.train.seq_length
    if s > m.max_position_embeddings and _position_rows(m):
        return _v(
            "seq-positions",
            f"train.seq_length={s} > model.max_position_embeddings={m.max_position_embeddings}, and model "
            f"{m.name} (family {m.family}) has learned absolute position embeddings: positions past "
            f"{m.max_position_embeddings} have no embedding row",
            f"set train.seq_length to at most {m.max_position_embeddings}, or raise model.max_position_embeddings "
            "(new rows start untrained)",
        )
    return []


# megatron-core's recompute_modules that run on these layers (moe_act needs its grouped-GEMM experts)
RECOMPUTE_ANY = ("core_attn", "mlp", "layernorm")


@RULES.run(reads=("model", "run"))
def recompute_modules(f: Facts) -> list[Violation]:
    """`train.recompute_modules` (with recompute=selective) names what megatron-core recomputes: each
    a module these layers have, so a typo or a module the model lacks is not silently ignored."""
    t, m = f.run.train, f.model
    if t.recompute != "selective":
        return []
    needs = {
        "moe": (m.is_moe, "an MoE model"),
        "shared_experts": (bool(m.moe_shared_expert_intermediate_size), "shared experts"),
        "mla_up_proj": (m.multi_latent_attention, "multi-latent attention"),
    }
    bad = [] if t.recompute_modules else ["none (an empty list recomputes nothing)"]
    for name in t.recompute_modules:
        if name == "moe_act":
            bad.append(
                "moe_act (megatron-core recomputes it only in grouped-GEMM experts, which these layers do not use)"
            )
        elif name in needs and not needs[name][0]:
            bad.append(f"{name} (needs {needs[name][1]}; model {m.name} has none)")
        elif name not in RECOMPUTE_ANY and name not in needs:
            bad.append(f"{name} (not one of {', '.join((*RECOMPUTE_ANY, *needs))})")
    if not bad:
        return []
    return _v(
        "recompute-modules",
        f"train.recompute_modules={list(t.recompute_modules)}: {'; '.join(bad)}",
        "list what to recompute among core_attn, mlp, layernorm (and moe, shared_experts, mla_up_proj where the "
        "model has them), e.g. train.recompute_modules=[core_attn,mlp]",
    )


# GPU generations with FP8 tensor cores: Ada (L4, L40S), Hopper (H100, H200, H20, GH200), Blackwell
FP8_GPUS = ("h100", "h200", "h20", "gh200", "l4", "l40", "b100", "b200", "gb200", "b300")


@RULES.run(reads=("run",))
def fp8_training(f: Facts) -> list[Violation]:
    """`train.precision=fp8` runs its GEMMs in float8 (runtime/fp8.py): refused up front on a
    GPU cluster without FP8 tensor cores. A CPU cluster (gloo) runs it: torch computes the float8
    GEMMs with float8 numerics, slowly (what CI tests)."""
    cfg = f.run
    c = cfg.cluster
    if cfg.train.precision != "fp8" or c.backend == "gloo" or any(g in c.name.lower() for g in FP8_GPUS):
        return []
    return _v(
        "fp8",
        "train.precision=fp8 needs GPUs with FP8 tensor cores (Hopper H100/H200, Ada L40S, Blackwell B200), "
        f"and cluster={c.name} names none (A100s and V100s have none)",
        "use train.precision=bf16, or a cluster group of such GPUs (cluster=dgx_h100)",
    )


def rope_in_force(m) -> str:
    """The rotary scaling the model uses, in words."""
    if m.rope_type == "default":
        return f"no rope scaling (rope_type default, rotary_base {m.rotary_base:g})"
    detail = ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in m.rope_params)
    return f"rope scaling {m.rope_type} ({detail}; rotary_base {m.rotary_base:g})"


def notes(m, cfg) -> list[str]:
    s = cfg.train.seq_length
    if s > m.max_position_embeddings and not _position_rows(m):
        return [
            f"warning: train.seq_length={s} > model.max_position_embeddings={m.max_position_embeddings} with rotary "
            f"positions and {rope_in_force(m)}: positions past {m.max_position_embeddings} were never trained"
        ]
    return []
