"""What a training step minimises, as one object both engines call (`objective=lm|dpo|distill`).

An `Objective` says how many rows a sample is (a preference pair is two), runs what the loss
needs besides the policy before a global batch (`prepare`: a frozen reference or teacher over
the same micro-batches), computes one micro-batch's loss from the policy's output (`loss`:
megatron-core's (sum, count, report) form, so `calculate_per_token_loss` divides the gradients
by the count of the whole global batch), and turns the report vectors summed over the global
batch into the logged loss and metrics (`result`). The engines hold no objective branches.
"""

from __future__ import annotations

import abc
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.runtime.packing import model_inputs

REPORT = "objective"
"""The key of a micro-batch's report vector in megatron-core's loss dict."""


def batch_to(batch: dict[str, Any], device) -> dict[str, Any]:
    """The micro-batch's tensors (and a VLM's image inputs, a dict of them) on `device`."""

    def to(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: to(x) for k, x in v.items()}
        return v.to(device) if torch.is_tensor(v) else v

    return {k: to(v) for k, v in batch.items()}


def token_losses(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """Per-token cross entropies of a micro-batch (the model computes them vocab-parallel from the
    labels, so no full-vocabulary logits are gathered)."""
    args, kwargs = model_inputs(batch)
    return model(*args, **kwargs)


class Objective(abc.ABC):
    rows_per_sample = 1  # model rows per dataset sample (a preference pair: chosen, rejected)
    report_size = 2  # length of the report vector `loss` returns and `result` reads
    reads_ahead = False  # True: `prepare` must see a global batch's micro-batches before the policy

    def prepare(self, batches: list[dict[str, Any]]) -> None:  # noqa: B027 - nothing by default
        """Before a global batch's forward passes (training and evaluation): add what the loss
        needs from a frozen model to each micro-batch, in place. Collective over the model-parallel
        group."""

    def forward(self, model: Any, batch: dict[str, Any]) -> torch.Tensor:
        """The policy's output for a micro-batch already on its device (default: `token_losses`)."""
        return token_losses(model, batch)

    @abc.abstractmethod
    def loss(self, batch: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sum to backpropagate, the count it is a sum over (int tensor), report vector)."""

    def count(self, batch: dict[str, Any]) -> float:
        """The micro-batch's share of the global denominator: its masked tokens (DPO: its pairs)."""
        return float(batch["loss_mask"].sum())

    @abc.abstractmethod
    def result(self, sums: torch.Tensor) -> tuple[float, dict[str, float]]:
        """(logged loss, other metrics) from the report vectors summed over the global batch."""

    def reduce(self, reports: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, float]]:
        """`result` of the micro-batches in `reports` summed over them and every DP·CP rank, known
        to every rank afterwards (the reports live on the last pipeline stage)."""
        acc = torch.zeros(self.report_size, dtype=torch.float64, device=comm_device())
        for r in reports:
            acc += r[REPORT].detach().to(acc.device, torch.float64)
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            torch.distributed.all_reduce(acc, group=ps.get_data_parallel_group(with_context_parallel=True))
        else:
            acc.zero_()
        torch.distributed.all_reduce(acc, group=ps.get_pipeline_model_parallel_group())
        return self.result(acc)


class NextToken(Objective):
    """`objective=lm`: the loss-masked token cross entropies summed over the global batch / their
    count (not a mean of per-micro-batch means, which weights short SFT batches up)."""

    def loss(self, batch, output):
        mask = batch["loss_mask"].float().view(-1)
        total = (output.float().view(-1) * mask).sum()
        return total, mask.sum().to(torch.int), torch.stack([total.detach().clone(), mask.sum().detach()])

    def result(self, sums):
        return float(sums[0] / sums[1].clamp(min=1)), {}


__all__ = ["REPORT", "NextToken", "Objective", "batch_to", "token_losses"]
