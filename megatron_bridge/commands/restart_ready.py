"""What `mbr launch max_restarts=N` adds so that a launcher brings a failed job back by itself.

A restart runs the very same command line again, so that line must serve the first launch
and every restart: `checkpoint.resume=auto` (continue from the latest complete checkpoint,
else start as configured). We refuse what would make a restart start over from step 0 (no
`checkpoint.dir`, no interval saves, an explicit `checkpoint.resume=false`) or silently not
restart at all (the deepspeed launcher has no restarts; a k8s policy of `Never`).

Each launcher gets its own mechanism: torchrun `--max-restarts=N` (its agent restarts the
workers of every node, here and under Slurm), Slurm `--requeue` for a node that fails or is
preempted (the allocation is requeued with the same script), and a PyTorchJob's pods
`restartPolicy: OnFailure` with `runPolicy.backoffLimit: N`. Multi-node c10d rendezvous gets
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: each rendezvous round then hands the workers a fresh
store, so a replacement node (whose restart count starts at 0) meets the others' keys.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.config.compose import Args
from megatron_bridge.errors import UserError

RESUME = "checkpoint.resume"
# Multi-node c10d: a fresh store per rendezvous round (see the module docstring).
FRESH_STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
K8S_RESTARTING = ("OnFailure", "ExitCode", "Always")  # the pod restart policies that restart


def enabled(cfg: Any) -> bool:
    """Whether the launch can run the job again after a failure: `max_restarts` > 0, or a k8s
    restart policy other than `Never`."""
    return cfg.max_restarts > 0 or (cfg.launcher == "k8s" and cfg.k8s.restart_policy in K8S_RESTARTING)


def _given(args: Args, key: str) -> bool:
    return any(o.split("=", 1)[0].lstrip("+~") == key for o in args.overrides)


def resume_args(cfg: Any, args: Args) -> list[str]:
    """Validate a restartable launch; the overrides to add to the job's command line
    (`checkpoint.resume=auto` unless the recipe already resumes)."""
    n = cfg.max_restarts
    if n < 0:
        raise UserError(f"max_restarts={n}: give how many times the launcher may restart the job (0 = never).")
    if n and cfg.launcher == "deepspeed":
        raise UserError(
            f"max_restarts={n}: the deepspeed launcher does not restart failed jobs. Fix: launcher=torchrun "
            "(train.engine=deepspeed runs under torchrun too), launcher=slurm or launcher=k8s."
        )
    if n and cfg.launcher == "k8s" and _given(args, "k8s.restart_policy") and cfg.k8s.restart_policy == "Never":
        raise UserError(
            f"max_restarts={n} with k8s.restart_policy=Never: the pods would never be restarted. "
            "Fix: drop k8s.restart_policy (max_restarts writes OnFailure) or set max_restarts=0."
        )
    if not enabled(cfg):
        return []
    why = f"max_restarts={n}" if n else f"k8s.restart_policy={cfg.k8s.restart_policy}"
    c = cfg.checkpoint
    if not c.dir:
        raise UserError(
            f"{why} restarts the job from its last checkpoint, and checkpoint.dir is not set: every restart "
            "would start over from step 0. Fix: checkpoint.dir=DIR checkpoint.save_interval=N (a fault then "
            "costs at most N steps)."
        )
    if not c.save_interval:
        raise UserError(
            f"{why} restarts the job from its last checkpoint, and checkpoint.save_interval=0 saves only at "
            "the end: a restart would start over from step 0. Fix: checkpoint.save_interval=N (a fault then "
            "costs at most N steps)."
        )
    if c.resume is False and _given(args, RESUME):
        raise UserError(
            f"{why} with checkpoint.resume=false: every restart would start over from step 0. Fix: drop "
            "checkpoint.resume (the launch writes checkpoint.resume=auto: resume when a checkpoint exists)."
        )
    return [] if c.resume else [f"{RESUME}=auto"]


def k8s_policy(cfg: Any) -> str:
    """The pods' restart policy: what the user gave, `OnFailure` when `max_restarts` asks for one."""
    return "OnFailure" if cfg.max_restarts and cfg.k8s.restart_policy == "Never" else cfg.k8s.restart_policy


def torchrun_flags(cfg: Any) -> list[str]:
    return [f"--max-restarts={cfg.max_restarts}"] if cfg.max_restarts else []


def env(cfg: Any) -> dict[str, str]:
    """Environment the launched agents need: a fresh rendezvous store per round when several
    nodes restart through c10d."""
    c = cfg.cluster
    return dict(FRESH_STORE_ENV) if cfg.max_restarts and c.nodes > 1 and c.rdzv_backend == "c10d" else {}
