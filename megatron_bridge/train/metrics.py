"""Per-step metrics to the console, `metrics.jsonl`, TensorBoard, wandb and MLflow — from one rank only.

Console: a rich progress bar on a TTY, one plain `step N | loss ...` line per log interval
otherwise (CI logs stay readable and greppable). `metrics.jsonl` is always written; the
others follow the recipe's `logger` group (config/schema.py LoggerConfig, docs/train.md).
TensorBoard writes under the run dir unless `logger.tensorboard.dir` says where. wandb runs
offline unless `logger.wandb.mode` or WANDB_MODE says otherwise, so it never asks for a login;
`WANDB_MODE=disabled` never imports it. MLflow (optional package) logs to its tracking URI.
A step's `val_loss` (when it evaluated) rides in the same row as its training metrics: one
`metrics.jsonl` line per step; TensorBoard files it under `valid/loss` beside `train/*`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.config.schema import LoggerConfig

TB_TAGS = {"val_loss": "valid/loss"}
"""TensorBoard tags that are not `train/<name>`."""


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        *,
        enabled: bool,
        loggers: LoggerConfig | None = None,
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.total = total_steps
        self.run_dir = Path(run_dir)
        self.tb = self.wandb = self.mlflow = self.progress = None
        self.history: list[dict[str, float]] = []
        if not enabled:
            return
        lg = loggers if loggers is not None else LoggerConfig()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        if lg.tensorboard.enabled:
            from torch.utils.tensorboard import SummaryWriter  # only when enabled: it loads tensorboard

            self.tb = SummaryWriter(lg.tensorboard.dir or str(self.run_dir / "tensorboard"))
        w = lg.wandb
        mode = w.mode or os.environ.get("WANDB_MODE") or "offline"
        if w.enabled and mode != "disabled":  # disabled: wandb is never imported
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb  # only when enabled: slow to import

            self.wandb = wandb.init(
                project=w.project,
                entity=w.entity,
                name=w.name,
                group=w.group,
                tags=list(w.tags) or None,
                mode=mode,  # type: ignore[arg-type]  # checked by the loggers rule (offline | online)
                dir=str(self.run_dir),
                config=config or {},
                reinit="finish_previous",
            )
        m = lg.mlflow
        if m.enabled:
            import mlflow  # optional (the mlflow extra); the loggers rule refuses a recipe without it

            if m.tracking_uri:
                if m.tracking_uri.startswith("file:"):  # MLflow 3 refuses a file store unless told it is wanted
                    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
                mlflow.set_tracking_uri(m.tracking_uri)
            mlflow.set_experiment(m.experiment)
            self.mlflow = mlflow.start_run(run_name=m.run_name)
            mlflow.log_params(_flat(config or {}))
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn  # on a TTY only

            self.progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("train", total=total_steps, info="")
            self.progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.history.append({"step": step, **metrics})
        self.jsonl.write(json.dumps({"step": step, **metrics, "time": time.time()}) + "\n")
        self.jsonl.flush()
        if self.tb:
            tb = self.tb

            def scalars() -> None:
                for k, v in metrics.items():
                    tb.add_scalar(TB_TAGS.get(k, f"train/{k}"), v, step)

            self._sink("tb", f"step {step}", scalars)
        if self.wandb:
            run = self.wandb
            self._sink("wandb", f"step {step}", lambda: run.log(metrics, step=step), release=_wandb_teardown)
        if self.mlflow:
            import mlflow  # imported by __init__ already

            self._sink(
                "mlflow",
                f"step {step}",
                lambda: mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step),
            )
        line = " | ".join(f"{k} {_fmt(v)}" for k, v in metrics.items())
        if self.progress:
            self.progress.update(self.task, completed=step, info=line)
        else:
            print(f"step {step:>5}/{self.total} | {line}", flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.progress:
            self.progress.stop()
        if self.tb:
            self._sink("tb", "the end", self.tb.close)
        if self.wandb:
            self._sink("wandb", "the end", self.wandb.finish, release=_wandb_teardown)
        if self.mlflow:
            import mlflow  # imported by __init__ already

            self._sink("mlflow", "the end", mlflow.end_run)
        self.jsonl.close()

    def _sink(
        self, attr: str, when: str, call: Callable[[], object], release: Callable[[], object] | None = None
    ) -> None:
        """A sink that fails (wandb's service process killed by the same SIGTERM a scheduler
        sends every process of the job, a full disk under TensorBoard, an MLflow server gone)
        is turned off with one warning; training and metrics.jsonl go on. A preempted run
        must still reach its checkpoint."""
        try:
            call()
        except Exception as e:  # noqa: BLE001 - any failure of a third-party sink
            setattr(self, attr, None)
            try:
                if release is not None:
                    release()
            except Exception:  # noqa: BLE001 - best effort: the sink is already broken
                pass
            name = {"tb": "TensorBoard", "wandb": "wandb", "mlflow": "MLflow"}[attr]
            print(
                f"warning: {name} failed at {when} ({type(e).__name__}: {e}); it is off for the rest of the run "
                f"(metrics.jsonl has every step)",
                file=sys.stderr,
                flush=True,
            )


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params (`layout`, `recipe.train.steps`, ...), values as strings
    cut to MLflow's 6000-character limit."""
    out: dict[str, str] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)[:6000]
    return out


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    a = abs(v)
    return f"{v:.3e}" if (a and (a < 1e-3 or a >= 1e5)) else f"{v:.4f}"


def gpu_metrics(cfg, dims, dt: float, spec) -> dict[str, float]:
    """MFU and memory of a step that took `dt` seconds, on GPU only (peak from cluster.peak_tflops)."""
    if not torch.cuda.is_available():
        return {}
    n = backend_of(spec).count(spec).active  # exact parameter count
    s, L, h = cfg.train.seq_length, spec.num_layers, spec.hidden_size
    flops_per_token = 6 * n + 12 * L * h * s  # dense matmuls + attention (Chinchilla / PaLM appendix)
    achieved = flops_per_token * dims.global_batch_size * s / dt / dims.world_size
    return {"mfu": achieved / (cfg.cluster.peak_tflops * 1e12), "mem_gb": torch.cuda.max_memory_allocated() / 2**30}


def _wandb_teardown() -> None:
    """Unregister wandb's atexit teardown (its first act), which would otherwise print a
    traceback at exit talking to the dead service process."""
    import wandb

    wandb.teardown()
