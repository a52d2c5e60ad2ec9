"""Per-step metrics to the console, TensorBoard and wandb — from one rank only.

Console: a rich progress bar on a TTY, one plain `step N | loss ...` line per log interval
otherwise (CI logs stay readable and greppable). TensorBoard writes under the run dir.
wandb runs offline unless the user set WANDB_MODE, so it never asks for a login.
A step's `val_loss` (when it evaluated) rides in the same row as its training metrics: one
`metrics.jsonl` line per step; TensorBoard files it under `valid/loss` beside `train/*`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from megatron_bridge.backends.registry import backend_of

TB_TAGS = {"val_loss": "valid/loss"}
"""TensorBoard tags that are not `train/<name>`."""


class MetricsLogger:
    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        *,
        enabled: bool,
        use_wandb: bool = True,
        use_tensorboard: bool = True,
        project: str = "megatron_bridge",
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.total = total_steps
        self.run_dir = Path(run_dir)
        self.tb = self.wandb = self.progress = None
        self.history: list[dict[str, float]] = []
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        if use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # only when enabled: it loads tensorboard

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        if use_wandb and os.environ.get("WANDB_MODE") != "disabled":  # disabled: wandb is never imported
            os.environ.setdefault("WANDB_MODE", "offline")
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb  # only when enabled: slow to import

            self.wandb = wandb.init(
                project=project, dir=str(self.run_dir), config=config or {}, reinit="finish_previous"
            )
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
            for k, v in metrics.items():
                self.tb.add_scalar(TB_TAGS.get(k, f"train/{k}"), v, step)
        if self.wandb:
            self.wandb.log(metrics, step=step)
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
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        self.jsonl.close()


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
