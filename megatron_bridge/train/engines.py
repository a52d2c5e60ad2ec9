"""Two engines, one interface: the runner builds an `Engine` through `make_engine` and never
asks which one it holds.

- `MegatronEngine`: megatron-core DDP + megatron optimizer (zero.stage=1 → its
  DistributedOptimizer), pipeline through `get_forward_backward_func` (1F1B, interleaved
  when vpp > 1), LR schedule from megatron-core's `OptimizerParamScheduler`.
- `DeepSpeedEngine`: `deepspeed.initialize` with ZeRO 0–3 on the same megatron-core model
  and groups (the `mpu` from runtime/groups.py), ds_config generated from the Hydra config.

Both compute the same loss — the sum of the loss-masked token cross-entropies over the global
batch divided by the number of masked tokens in it (across micro-batches, DP and CP ranks; not a
mean of per-micro-batch means, which weights short SFT batches up) — and its exact gradient, in
training steps and in forward-only evaluation alike, through the one `_forward_step`/`_loss_func`
(packed SFT micro-batches through runtime/packing.py's `model_inputs`), and are
checkpointed through `state_dict()` / `load_state_dict()` (this rank's share only) plus
`write_extra()` for the files an engine keeps itself (DeepSpeed's ZeRO partitions).
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from megatron.core import parallel_state as ps
from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_bridge.convert.formats.pickle_guard import TRAINING
from megatron_bridge.errors import UserError
from megatron_bridge.runtime import cpu
from megatron_bridge.runtime.build import model_config
from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.runtime.lora_modules import adapters, load_model_state, model_state
from megatron_bridge.runtime.packing import model_inputs, schedule_shape
from megatron_bridge.runtime.safe_load import only_weights
from megatron_bridge.runtime.schedule import wrap_ddp
from megatron_bridge.train.data.sft import is_packed
from megatron_bridge.train.ds_config import build_ds_config
from megatron_bridge.train.optim_state import dist_model_params, load_named_state, named_state

MakeIterators = Callable[[int], list[Any]]
"""`make_iterators(n)`: n fresh iterators over this step's micro-batches, one per model chunk
(interleaved pipelines walk the same data once per chunk)."""


class StepResult(NamedTuple):
    """What one `Engine.step` did, the same on every rank."""

    loss: float  # mean token loss over the global batch
    grad_norm: float  # global gradient norm before clipping
    lr: float  # the rate this step applied (or would have)
    applied: bool  # False: the loss or gradient norm was not finite, and parameters, optimizer
    # state and lr schedule were left as they were (the step's data is consumed all the same)


def finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


class Engine(abc.ABC):
    """Everything the training runner may ask of an engine. The runner holds no engine-type
    branches, so an engine is one subclass plus one `ENGINES` entry.

    Every engine is built with the same arguments (`make_engine`), checkpoints through the same
    calls, and keeps the unwrapped megatron-core modules in `model_chunks`: what the HF export
    and evaluation read, whichever wrapper (megatron DDP, DeepSpeed) trains them."""

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
        """`global_names(chunk)`: {a chunk's parameter name: its table name} (the backend's:
        runtime/runtimes.py), the names a checkpoint keys optimizer state by (default: the
        chunk's own)."""
        self.cfg, self.dims = cfg, dims
        self.global_names = global_names or (lambda chunk: {name: name for name, _ in chunk.named_parameters()})
        self.model_chunks: list[torch.nn.Module] = list(chunks)
        self.device = next(chunks[0].parameters()).device

    @abc.abstractmethod
    def step(self, make_iterators: MakeIterators) -> StepResult:
        """One optimizer step over the global batch, known to every rank. A step whose loss or
        gradient norm is not finite updates nothing (`applied=False`): what the runner does
        then is `train.on_nonfinite`'s business."""

    @abc.abstractmethod
    def evaluate(self, make_iterators: MakeIterators, iters: int) -> float:
        """Mean token loss over `iters` global batches, forward only: the model in eval mode (no
        dropout), no gradients, optimizer and schedule untouched; the training step's loss
        function, summed over every token of every micro-batch and reduced over DP and CP before
        the one division, so the value does not depend on the layout. Known to every rank.
        `make_iterators` yields the `iters`·grad_accum micro-batches in order."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's share of the training state, for its checkpoint file."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any], directory: Path) -> None:
        """Restore what `state_dict()` returned; `directory` is the checkpoint it came from,
        holding whatever `write_extra` wrote there."""

    def write_extra(self, directory: Path) -> None:  # noqa: B027 - a no-op default, on purpose
        """Engine-owned files, written on every rank into the checkpoint directory before it is
        published (the manifest checksums them). None by default."""


def _batch_to(batch: dict[str, Any], device) -> dict[str, Any]:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """Per-token losses [b, s] (or a packed [1, b·s]) -> (masked sum, masked tokens, report) —
    megatron-core's 3-tuple form. With `calculate_per_token_loss` (set by MegatronEngine) the
    schedule backpropagates the sum as is, DDP sums gradients over dp·cp, and
    `finalize_model_grads` divides them by the masked tokens of the whole global batch (all-reduced
    over dp·cp, broadcast over pp): the gradient of the global masked mean."""
    mask = loss_mask.float().view(-1)
    total = (output.float().view(-1) * mask).sum()
    n = mask.sum().to(torch.int)
    return total, n, {"lm loss": torch.stack([total.detach().clone(), mask.sum().detach()])}


def _forward_step(device):
    def step(data_iterator, model):
        b = _batch_to(next(data_iterator), device)
        args, kwargs = model_inputs(b)
        out = model(*args, **kwargs)
        return out, lambda output: _loss_func(b["loss_mask"], output)

    return step


def make_scheduler(optimizer, cfg):
    """Linear warmup then `optimizer.decay_style` decay to min_lr over train.steps (megatron-
    core's scheduler; works on any optimizer's param_groups). Warmup is capped at steps − 1."""
    o, steps = cfg.optimizer, max(cfg.train.steps, 2)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=min(o.min_lr, o.lr),
        lr_warmup_steps=min(o.warmup_steps, steps - 1),
        lr_decay_steps=steps,
        lr_decay_style=o.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=steps,
        wd_incr_style="constant",
    )


def _reduce_loss(reports: list[dict[str, torch.Tensor]]) -> float:
    """Mean token loss of the micro-batches in `reports` (sum of token losses / token count over
    all of them and all DP·CP ranks), known to every rank afterwards."""
    acc = torch.zeros(2, dtype=torch.float64, device=comm_device())
    for r in reports:
        acc += r["lm loss"].detach().to(acc.device, torch.float64)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        torch.distributed.all_reduce(acc, group=ps.get_data_parallel_group(with_context_parallel=True))
    else:
        acc.zero_()
    torch.distributed.all_reduce(acc, group=ps.get_pipeline_model_parallel_group())
    return float(acc[0] / acc[1].clamp(min=1))


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
    ):
        """`mpu` and `bf16` go unused: megatron-core reads its groups from `parallel_state` and
        the precision from the chunks' TransformerConfig (built with the same `bf16`)."""
        super().__init__(cfg, dims, chunks, mpu, bf16=bf16, global_names=global_names)
        tconf = model_config(self.model_chunks)
        tconf.calculate_per_token_loss = True  # read by the schedule, DDP (built next) and finalize
        self.model = wrap_ddp(chunks, distributed_optimizer=dims.zero_stage == 1)
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
        d = self.dims
        seq, mbs = schedule_shape(
            self.cfg.train.seq_length // d.cp, d.micro_batch_size, packed=is_packed(self.cfg.data)
        )
        return get_forward_backward_func()(
            forward_step_func=_forward_step(self.device),
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
        loss = _reduce_loss(reports)
        # megatron's `optimizer.step()` split open (as its ChainedOptimizer does it), so that the
        # norm is known before anything changes: fp32/bf16 training has no grad scaler to skip a
        # non-finite step, and clipping by a NaN norm would write NaN into every weight.
        found_inf = self.optimizer.prepare_grads()  # main grads ready; True only under fp16 loss scaling
        grad_norm = float(self.optimizer.get_grad_norm())  # all-reduced: the same on every rank
        if found_inf or not finite(loss, grad_norm):
            return StepResult(loss, grad_norm, lr, applied=False)
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
        return StepResult(loss, grad_norm, lr, applied=True)

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
        return _reduce_loss(reports)

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
        with _model_must_fit(directory):
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


@contextlib.contextmanager
def _model_must_fit(directory: Path) -> Iterator[None]:
    """A checkpoint of another model (its layout string and engine match, its tensors do not):
    one message instead of `load_state_dict`'s traceback."""
    try:
        yield
    except RuntimeError as e:
        if "Error(s) in loading state_dict" not in str(e):
            raise
        detail = " ".join(str(e).split())
        raise UserError(
            f"cannot resume {directory}: it holds the state of another model than this run builds "
            f"({detail[:300]}{'…' if len(detail) > 300 else ''}). Resume with the model it was written "
            "with (the same model.* settings or model.hf_path), or give this run a new checkpoint.dir."
        ) from None


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
            b = _batch_to(b, self.device)
            args, kwargs = model_inputs(b)
            out = self.engine(*args, **kwargs)
            total, n, rep = _loss_func(b["loss_mask"], out)
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
            b = _batch_to(next(it), self.device)
            args, kwargs = model_inputs(b)
            out = self.engine(*args, **kwargs)
            reports.append(_loss_func(b["loss_mask"], out)[2])
        return _reduce_loss(reports)

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
        with only_weights(TRAINING), _model_must_fit(directory):
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


ENGINES: dict[str, type[Engine]] = {"megatron": MegatronEngine, "deepspeed": DeepSpeedEngine}
"""`train.engine` → its engine. `mbr check` validates the name against
`parallel.rules.CHOICES["train.engine"]` without importing torch; tests/unit/train/test_engines.py
holds the two equal."""


def make_engine(cfg: Any, dims: Any, chunks: Sequence[torch.nn.Module], mpu: Any, *, bf16: bool, **kw: Any) -> Engine:
    """The engine `cfg.train.engine` names, around the built and initialised model chunks
    (`kw`: `Engine.__init__`'s `global_names`)."""
    return ENGINES[cfg.train.engine](cfg, dims, chunks, mpu, bf16=bf16, **kw)
