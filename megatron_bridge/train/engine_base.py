"""What both engines share: the interface (`Engine`), the step's result, the forward step, the LR
schedule, and one message for a checkpoint of another model.

What a step minimises is the engine's `objective` (train/objectives/): by default the sum of the
loss-masked token cross-entropies over the global batch divided by the number of masked tokens in
it (across micro-batches, DP and CP ranks), in training steps and forward-only evaluation alike,
through the one `forward_step` (packed SFT micro-batches through runtime/packing.py's
`model_inputs`). The engines are train/engine_megatron.py and
train/engine_deepspeed.py; train/engines.py registers them.
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_bridge.errors import UserError
from megatron_bridge.train.objectives.base import REPORT, NextToken, Objective, batch_to
from megatron_bridge.train.stragglers import StepPhases

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
    metrics: dict[str, float] = {}  # the objective's others (DPO's rewards), for the step's log line


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
        objective: Objective | None = None,
    ):
        """`objective`: what a step minimises (train/objectives/; default next-token cross
        entropy). `global_names(chunk)`: {a chunk's parameter name: its table name} (the backend's:
        runtime/runtimes.py), the names a checkpoint keys optimizer state by (default: the
        chunk's own)."""
        self.cfg, self.dims = cfg, dims
        self.global_names = global_names or (lambda chunk: {name: name for name, _ in chunk.named_parameters()})
        self.model_chunks: list[torch.nn.Module] = list(chunks)
        self.device = next(chunks[0].parameters()).device
        self.objective: Objective = objective or NextToken()
        # This rank's compute vs waiting-on-peers seconds (stragglers.py); each engine marks its
        # collectives whose peers may be late with `phases.waiting()`.
        self.phases = StepPhases()

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


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """`objective=lm`'s loss of per-token losses [b, s] (or a packed [1, b·s]): (masked sum, masked
    tokens, report) — megatron-core's 3-tuple form. With `calculate_per_token_loss` (set by
    MegatronEngine) the schedule backpropagates the sum as is, DDP sums gradients over dp·cp, and
    `finalize_model_grads` divides them by the count of the whole global batch (all-reduced over
    dp·cp, broadcast over pp): the gradient of the global masked mean."""
    return NextToken().loss({"loss_mask": loss_mask}, output)


def forward_step(device, objective: Objective):
    """megatron-core's forward step: the objective's forward of the next micro-batch, and its loss."""

    def step(data_iterator, model):
        b = batch_to(next(data_iterator), device)
        out = objective.forward(model, b)

        def loss(output):
            total, n, report = objective.loss(b, output)
            return total, n, {REPORT: report}

        return out, loss

    return step


def global_batch(its: list[Any], micro_batches: int, objective: Objective) -> list[Any]:
    """The iterators one global batch is read through: `its` as they are, or — an objective with
    a frozen model (`reads_ahead`) — the next `micro_batches` micro-batches read from `its[0]`,
    `prepare`d (the frozen model's pass over them), and served again to each of `len(its)` chunks."""
    if not objective.reads_ahead:
        return its
    batches = [next(its[0]) for _ in range(micro_batches)]
    objective.prepare(batches)
    return [iter(batches) for _ in its]


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


@contextlib.contextmanager
def model_must_fit(directory: Path) -> Iterator[None]:
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


__all__ = ["Engine", "MakeIterators", "StepResult", "finite", "make_scheduler"]
