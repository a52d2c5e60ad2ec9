"""`MegatronEngine`: megatron-core DDP + megatron optimizer (zero.stage=1 → its
DistributedOptimizer), pipeline through `get_forward_backward_func` (1F1B, interleaved when
vpp > 1), LR schedule from megatron-core's `OptimizerParamScheduler`. Its checkpoint state is this
rank's chunks and its optimizer's state per parameter name (train/optim_state.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_bridge.runtime.build import model_config
from megatron_bridge.runtime.lora_modules import load_model_state, model_state
from megatron_bridge.runtime.packing import schedule_shape
from megatron_bridge.runtime.schedule import wrap_ddp
from megatron_bridge.train.data.sft import is_packed
from megatron_bridge.train.engine_base import (
    Engine,
    MakeIterators,
    StepResult,
    finite,
    forward_step,
    global_batch,
    make_scheduler,
    model_must_fit,
)
from megatron_bridge.train.objectives.base import Objective
from megatron_bridge.train.optim_state import dist_model_params, load_named_state, named_state


class MegatronEngine(Engine):
    """megatron-core's own training loop pieces: DDP (`wrap_ddp`, the one wrapping the bridge
    also verifies with), its optimizer and pipeline schedules."""

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
        """`mpu` and `bf16` go unused: megatron-core reads its groups from `parallel_state` and
        the precision from the chunks' TransformerConfig (built with the same `bf16`)."""
        super().__init__(cfg, dims, chunks, mpu, bf16=bf16, global_names=global_names, objective=objective)
        tconf = model_config(self.model_chunks)
        tconf.calculate_per_token_loss = True  # read by the schedule, DDP (built next) and finalize
        self.model = wrap_ddp(chunks, distributed_optimizer=dims.zero_stage == 1)
        for conf in {id(w.config): w.config for w in self.model}.values():  # the gradient sync waits on peers
            conf.finalize_model_grads_func = self.phases.marked(conf.finalize_model_grads_func)
        o = cfg.optimizer
        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=tconf.bf16,
            params_dtype=tconf.params_dtype,
            use_distributed_optimizer=dims.zero_stage == 1,
        )
        self.optimizer = get_megatron_optimizer(ocfg, self.model)
        self.scheduler = make_scheduler(self.optimizer, cfg)

    def _schedule(self, its: list[Any], *, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """One global batch through megatron-core's pipeline schedule; the loss reports of the
        micro-batches (on the last stage)."""
        d, obj = self.dims, self.objective
        its = global_batch(its, d.grad_accum, obj)
        seq, mbs = schedule_shape(
            self.cfg.train.seq_length // d.cp, d.micro_batch_size * obj.rows_per_sample, packed=is_packed(self.cfg.data)
        )
        return get_forward_backward_func()(
            forward_step_func=forward_step(self.device, obj),
            data_iterator=its if len(self.model) > 1 else its[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=d.grad_accum,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=forward_only,
        )

    def step(self, make_iterators: MakeIterators) -> StepResult:
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._schedule(make_iterators(len(self.model)), forward_only=False)
        lr = float(self.optimizer.param_groups[0]["lr"])  # the rate this step applies
        loss, metrics = self.objective.reduce(reports)
        # megatron's `optimizer.step()` split open (as its ChainedOptimizer does it), so that the
        # norm is known before anything changes: fp32/bf16 training has no grad scaler to skip a
        # non-finite step, and clipping by a NaN norm would write NaN into every weight.
        found_inf = self.optimizer.prepare_grads()  # main grads ready; True only under fp16 loss scaling
        grad_norm = float(self.optimizer.get_grad_norm())  # all-reduced: the same on every rank
        if found_inf or not finite(loss, grad_norm):
            return StepResult(loss, grad_norm, lr, applied=False, metrics=metrics)
        for opt in self._optimizers():
            params = opt.get_parameters()
            if opt.config.clip_grad > 0.0 and params:
                clip_grad_by_total_norm_fp32(
                    params,
                    max_norm=opt.config.clip_grad,
                    total_norm=grad_norm,
                    use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                )
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        return StepResult(loss, grad_norm, lr, applied=True, metrics=metrics)

    @torch.no_grad()
    def evaluate(self, make_iterators: MakeIterators, iters: int) -> float:
        """megatron-LM's `evaluate`: the pipeline schedule with forward_only=True, once per
        global batch (the same micro-batch count as a step, so interleaving's rules hold)."""
        for m in self.model:
            m.eval()
        its = make_iterators(len(self.model))
        reports: list[dict[str, torch.Tensor]] = []
        for _ in range(iters):
            reports += self._schedule(its, forward_only=True)
        return self.objective.reduce(reports)[0]

    # -- checkpoint state (this rank's share) -------------------------------------------
    def _optimizers(self) -> list[Any]:
        """megatron-core chains one optimizer per parameter kind (dense / expert) when needed."""
        opt = self.optimizer
        return list(opt.chained_optimizers) if isinstance(opt, ChainedOptimizer) else [opt]

    def state_dict(self) -> dict[str, Any]:
        names, params = self._names()
        opts = []
        for opt in self._optimizers():  # each parameter's state under its name (train/optim_state.py)
            entry: dict[str, Any] = {"named": named_state(opt, names, params)}
            if getattr(opt, "grad_scaler", None) is not None:
                entry["grad_scaler"] = opt.grad_scaler.state_dict()
            opts.append(entry)
        return {
            "model": [model_state(c) for c in self.model_chunks],  # adapters only under LoRA
            "optimizer": opts,
            "scheduler": self.scheduler.state_dict(),
        }

    def _names(self) -> tuple[dict[int, str], list[torch.nn.Parameter]]:
        """{id(model param): its table name} and the params, over this rank's chunks."""
        names: dict[int, str] = {}
        params = []
        for c in self.model_chunks:
            table = self.global_names(c)
            for local, p in c.named_parameters():
                names[id(p)] = table[local]
                params.append(p)
        return names, params

    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        with model_must_fit(directory):
            for c, sd in zip(self.model_chunks, state["model"]):
                load_model_state(c, sd)
        saved = state["optimizer"]
        if all("named" in st for st in saved):  # every parameter by name, whichever optimizer held it
            named = {k: v for st in saved for k, v in st["named"].items()}
            names, params = self._names()
            for i, opt in enumerate(self._optimizers()):
                load_named_state(opt, names, params, named)
                scaler = saved[i].get("grad_scaler") if i < len(saved) else None
                if scaler is not None and getattr(opt, "grad_scaler", None) is not None:
                    opt.grad_scaler.load_state_dict(scaler)
        else:  # written before the state was keyed by name: the same layout only
            for opt, st in zip(self._optimizers(), saved):
                if "dist" in st:
                    _load_dist_opt_states(opt, st["dist"])
                else:
                    opt.load_state_dict(st["plain"])
        self.scheduler.load_state_dict(state["scheduler"])


@torch.no_grad()
def _load_dist_opt_states(opt, saved) -> None:
    """Put back this rank's main-param shards and Adam states. Each state tensor is set as
    its own clone: megatron's `load_state_dict` path shares one `step` tensor between all
    params, which Adam then increments once per param (a resumed run would drift)."""
    for model_param, tensors in zip(dist_model_params(opt), saved):
        gi, go = opt.model_param_group_index_map[model_param]
        main = opt.optimizer.param_groups[gi]["params"][go]
        main.copy_(tensors["param"])
        opt.optimizer.state[main] = {k: v.clone() for k, v in tensors.items() if k != "param"}


__all__ = ["MegatronEngine"]
