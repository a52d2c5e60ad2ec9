"""`DeepSpeedEngine`: `deepspeed.initialize` with ZeRO 0–3 on the same megatron-core model and
groups (the `mpu` from runtime/groups.py), ds_config generated from the Hydra config; its model
and optimizer state live in DeepSpeed's own files (`write_extra`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.convert.formats.pickle_guard import TRAINING
from megatron_bridge.runtime import cpu
from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.runtime.lora_modules import adapters
from megatron_bridge.runtime.packing import model_inputs
from megatron_bridge.runtime.safe_load import only_weights
from megatron_bridge.train.ds_config import build_ds_config
from megatron_bridge.train.engine_base import (
    Engine,
    MakeIterators,
    StepResult,
    batch_to,
    loss_func,
    make_scheduler,
    model_must_fit,
    reduce_loss,
)


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO 0–3 around the megatron-core model. Validation limits it to pp = cp = ep = 1
    and no sequence parallelism: DeepSpeed reduces gradients over the DP group only, and knows
    nothing of megatron's pipeline schedule, CP/SP gradient reductions or expert-DP groups."""

    def __init__(
        self,
        cfg: Any,
        dims: Any,
        chunks: Sequence[torch.nn.Module],
        mpu: Any,
        *,
        bf16: bool,
        global_names: Callable[[Any], dict[str, str]] | None = None,
    ):
        import deepspeed  # on demand: importing it takes ~1.5 s and logs its accelerator choice on every run
        from deepspeed.git_version_info import installed_ops  # the ops built into the wheel

        super().__init__(cfg, dims, chunks, mpu, bf16=bf16, global_names=global_names)
        module = chunks[0]
        # DeepSpeed's FusedAdam only where its CUDA op was built into the wheel: otherwise
        # DeepSpeed JIT-compiles it at the first step (nvcc needed, minutes; on an H200 with
        # torch 2.11 it failed outright parsing the compute capability "9.0a"); torch's Adam
        # (multi-tensor on CUDA) is used instead.
        fused = torch.cuda.is_available() and bool(installed_ops.get("fused_adam"))
        self.ds_config = build_ds_config(cfg, dims, bf16=bf16, fused_adam=fused)
        cpu.deepspeed_without_shm_op()
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=self.ds_config,
            mpu=mpu,
        )
        self.scheduler = make_scheduler(self.optimizer, cfg)
        self.scheduler.step(0)
        # LoRA: save the adapters only (the base comes back from the base model). Not "any frozen
        # parameter": a model's own frozen weights (DeepSeek-V3's correction bias) must be saved.
        self._frozen = any(True for _ in adapters(module))

    def step(self, make_iterators: MakeIterators) -> StepResult:
        it = make_iterators(1)[0]
        self.engine.train()
        batches = [next(it) for _ in range(self.dims.grad_accum)]
        # DeepSpeed divides each backward by grad_accum and averages gradients over DP; scaling the
        # masked sums by grad_accum·dp / (masked tokens of the global batch) leaves the gradient of
        # the global masked mean, as megatron's per-token loss does.
        dev = comm_device()
        tokens = torch.tensor(float(sum(b["loss_mask"].sum() for b in batches)), dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(tokens, group=ps.get_data_parallel_group())
        dp = torch.distributed.get_world_size(ps.get_data_parallel_group())
        scale = self.dims.grad_accum * dp / max(float(tokens), 1.0)
        acc = torch.zeros(2, dtype=torch.float64, device=dev)
        skipped_before, update = self.engine.skipped_steps, True
        for i, b in enumerate(batches):
            b = batch_to(b, self.device)
            args, kwargs = model_inputs(b)
            out = self.engine(*args, **kwargs)
            total, n, rep = loss_func(b["loss_mask"], out)
            acc += rep["lm loss"].to(dev, torch.float64)
            self.engine.backward(total * scale)
            if i == len(batches) - 1:  # the accumulation boundary: the gradients are reduced now
                torch.distributed.all_reduce(acc, group=ps.get_data_parallel_group())
                update = self._update_is_finite(float(acc[0] / acc[1].clamp(min=1)))
            with contextlib.nullcontext() if update else _no_update(self.engine.optimizer):
                self.engine.step()
        lr = float(self.optimizer.param_groups[0]["lr"])
        applied = update and self.engine.skipped_steps == skipped_before  # ZeRO 1/2 skip a NaN norm themselves
        if applied:
            self.scheduler.step(increment=1)
        gn = self.engine.get_global_grad_norm()
        loss = float(acc[0] / acc[1].clamp(min=1))
        return StepResult(loss, float(gn or 0.0) if applied else math.nan, lr, applied=applied)

    def _update_is_finite(self, loss: float) -> bool:
        """Whether the reduced loss, and (ZeRO-0, where DeepSpeed checks nothing in fp32) every
        reduced gradient, are finite — agreed by all ranks. ZeRO 1–3 check their own partitions
        and skip a non-finite norm (counted in DeepSpeed's `skipped_steps`)."""
        bad = torch.tensor([0.0 if math.isfinite(loss) else 1.0], device=comm_device())
        if self.dims.zero_stage == 0:
            grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
            if grads and not torch.isfinite(torch.stack([g.float().sum() for g in grads]).sum()):
                bad.fill_(1.0)  # a sum is non-finite iff an element is (fp32 sums of grads do not overflow)
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    @torch.no_grad()
    def evaluate(self, make_iterators: MakeIterators, iters: int) -> float:
        """The DeepSpeed engine's forward in eval mode (ZeRO-3 gathers the partitioned weights
        as in training), one micro-batch at a time."""
        it = make_iterators(1)[0]
        self.engine.eval()
        reports = []
        for _ in range(iters * self.dims.grad_accum):
            b = batch_to(next(it), self.device)
            args, kwargs = model_inputs(b)
            out = self.engine(*args, **kwargs)
            reports.append(loss_func(b["loss_mask"], out)[2])
        return reduce_loss(reports)

    def state_dict(self) -> dict[str, Any]:
        """The scheduler only: model and optimizer state live in DeepSpeed's own files."""
        return {"scheduler": self.scheduler.state_dict()}

    def write_extra(self, directory: Path) -> None:
        """DeepSpeed's own per-rank model/optimizer files (ZeRO partitions included)."""
        self.engine.save_checkpoint(
            str(directory), tag="deepspeed", save_latest=False, exclude_frozen_parameters=self._frozen
        )

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        # DeepSpeed loads its files with torch.load(weights_only=False): made data-only here
        with only_weights(TRAINING), model_must_fit(directory):
            self._load_checkpoint(directory)
        self.scheduler.load_state_dict(state["scheduler"])

    def _load_checkpoint(self, directory: Path) -> None:
        self.engine.load_checkpoint(
            str(directory),
            tag="deepspeed",
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=not self._frozen,
        )


@contextlib.contextmanager
def _no_update(optimizer) -> Iterator[None]:
    """DeepSpeed's `engine.step()` with its optimizer's update left out: its counters advance and
    the gradients are cleared as after any step, the parameters and Adam's state stay."""
    optimizer.step = lambda *args, **kwargs: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        del optimizer.step


__all__ = ["DeepSpeedEngine"]
