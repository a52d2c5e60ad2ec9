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
from megatron_bridge.runtime.safe_load import only_weights
from megatron_bridge.train.ds_config import build_ds_config
from megatron_bridge.train.engine_base import (
    Engine,
    MakeIterators,
    StepResult,
    batch_to,
    global_batch,
    make_scheduler,
    model_must_fit,
)
from megatron_bridge.train.objectives.base import REPORT, Objective


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
        objective: Objective | None = None,
    ):
        import deepspeed  # on demand: importing it takes ~1.5 s and logs its accelerator choice on every run
        from deepspeed.git_version_info import installed_ops  # the ops built into the wheel

        super().__init__(cfg, dims, chunks, mpu, bf16=bf16, global_names=global_names, objective=objective)
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
        obj, n = self.objective, self.dims.grad_accum
        it = global_batch(make_iterators(1), n, obj)[0]
        self.engine.train()
        batches = [next(it) for _ in range(n)]
        # DeepSpeed divides each backward by grad_accum and averages gradients over DP; scaling the
        # objective's sums by grad_accum·dp / (its count over the global batch: masked tokens, pairs)
        # leaves the gradient of the global mean, as megatron's per-token loss does.
        dev = comm_device()
        count = torch.tensor(sum(obj.count(b) for b in batches), dtype=torch.float64, device=dev)
        with self.phases.waiting():  # the first collective: a late peer is waited for here
            torch.distributed.all_reduce(count, group=ps.get_data_parallel_group())
        dp = torch.distributed.get_world_size(ps.get_data_parallel_group())
        scale = n * dp / max(float(count), 1.0)
        acc = torch.zeros(obj.report_size, dtype=torch.float64, device=dev)
        skipped_before, update = self.engine.skipped_steps, True
        for i, b in enumerate(batches):
            b = batch_to(b, self.device)
            total, _, report = obj.loss(b, obj.forward(self.engine, b))
            acc += report.to(dev, torch.float64)
            last = i == len(batches) - 1  # the accumulation boundary: the gradients are reduced now
            with self.phases.waiting() if last else contextlib.nullcontext():
                self.engine.backward(total * scale)
            if last:
                torch.distributed.all_reduce(acc, group=ps.get_data_parallel_group())
                update = self._update_is_finite(obj.result(acc)[0])
            with contextlib.nullcontext() if update else _no_update(self.engine.optimizer):
                self.engine.step()
        lr = float(self.optimizer.param_groups[0]["lr"])
        applied = update and self.engine.skipped_steps == skipped_before  # ZeRO 1/2 skip a NaN norm themselves
        if applied:
            self.scheduler.step(increment=1)
        gn = self.engine.get_global_grad_norm()
        loss, metrics = obj.result(acc)
        return StepResult(loss, float(gn or 0.0) if applied else math.nan, lr, applied=applied, metrics=metrics)

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
        obj, its = self.objective, make_iterators(1)
        self.engine.eval()
        reports = []
        for _ in range(iters):
            it = global_batch(its, self.dims.grad_accum, obj)[0]
            for _ in range(self.dims.grad_accum):
                b = batch_to(next(it), self.device)
                reports.append({REPORT: obj.loss(b, obj.forward(self.engine, b))[2]})
        return obj.reduce(reports)[0]

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
