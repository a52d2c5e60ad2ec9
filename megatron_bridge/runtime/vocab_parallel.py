"""The objectives' math on logits sharded along the vocabulary over the tensor-parallel group:
log-probabilities, divergences, cross entropy (−log p(label): also DPO's per-token log-prob)
and the distillation loss.

megatron-core's output layer leaves each TP rank the contiguous slice
[rank·v/tp, (rank+1)·v/tp) of the padded vocabulary. Gathering the full rows would cost
tp× the logits memory, so every reduction over the vocabulary here is a local partial one
followed by an all-reduce over `group`: the max (a constant shift, no gradient), the sum of
exponentials and the per-token sums of the divergences. Every rank ends with the same
per-token values, so the backward of their final sum is the identity (`_SumOverGroup`,
megatron's reduce-from-TP-region), while the normaliser's gradient, which each rank's columns
contribute a part of, is summed over the group (torch.distributed.nn's all_reduce): each
rank's logits receive exactly their slice of the full-vocab gradient. Columns at or past
`vocab_size` (megatron's padding) get probability 0. `group=None` is the unsharded case (tp=1).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from megatron_bridge.parallel.rules.degrees import CHOICES

DIVERGENCES = CHOICES["objective.divergence"]
JSD_BETA = 0.5  # TRL GKDTrainer.generalized_jsd_loss's default mixture weight


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: the result is replicated on every rank and
    each rank's loss is that same value, so each rank's partial sum gets the output's gradient."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sum(x: torch.Tensor, group) -> torch.Tensor:
    """Per-token sum over the (sharded) vocabulary dimension: a final, replicated value."""
    x = x.sum(dim=-1)
    return x if _world(group) == 1 else _SumOverGroup.apply(x, group)


def _normaliser(x: torch.Tensor, group) -> torch.Tensor:
    """Σ exp over the vocabulary, used again by every rank's columns: its gradient is summed."""
    x = x.sum(dim=-1)
    return x if _world(group) == 1 else dist_nn.all_reduce(x, group=group)


def _valid_columns(logits: torch.Tensor, group, vocab_size: int | None) -> torch.Tensor | None:
    """Boolean [v_local]: this rank's columns whose global index is a real token (None: all)."""
    if vocab_size is None:
        return None
    local = logits.shape[-1]
    start = (0 if group is None else dist.get_rank(group)) * local
    cols = torch.arange(start, start + local, device=logits.device)
    return None if start + local <= vocab_size else cols < vocab_size


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, group=None, vocab_size: int | None = None):
    """Vocab-parallel log-softmax of logits/temperature in fp32 (padded columns are -inf)."""
    x = logits.float() / temperature
    valid = _valid_columns(x, group, vocab_size)
    if valid is not None:
        x = x.masked_fill(~valid, -math.inf)
    top = x.detach().max(dim=-1, keepdim=True).values
    if _world(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = x - top
    total = _normaliser(shifted.exp(), group)
    return shifted - total.log().unsqueeze(-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor | None, group) -> torch.Tensor:
    """Per-token KL(p || q) = Σ p·(log p − log q) over the real columns."""
    terms = log_p.exp() * (log_p - log_q)
    if valid is not None:
        terms = terms.masked_fill(~valid, 0.0)
    return _sum(terms, group)


def divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str,
    temperature: float = 1.0,
    group=None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token divergence [...] between the distributions at `temperature`: forward_kl =
    KL(teacher || student), reverse_kl = KL(student || teacher), jsd = TRL's generalized JSD at
    beta 0.5. The teacher is a constant (no gradient reaches it)."""
    if kind not in DIVERGENCES:
        raise ValueError(f"divergence kind={kind!r}: one of {DIVERGENCES}")
    s = log_softmax(student_logits, temperature, group, vocab_size)
    with torch.no_grad():
        t = log_softmax(teacher_logits.detach(), temperature, group, vocab_size)
    valid = _valid_columns(s, group, vocab_size)
    if valid is not None:  # 0 instead of -inf: the masked terms are dropped, never NaN
        s, t = s.masked_fill(~valid, 0.0), t.masked_fill(~valid, 0.0)
    if kind == "forward_kl":
        return _kl(t, s, valid, group)
    if kind == "reverse_kl":
        return _kl(s, t, valid, group)
    mixture = torch.logsumexp(torch.stack([s + math.log1p(-JSD_BETA), t + math.log(JSD_BETA)]), dim=0)
    return JSD_BETA * _kl(t, mixture, valid, group) + (1 - JSD_BETA) * _kl(s, mixture, valid, group)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group=None, vocab_size: int | None = None):
    """Per-token −log p(label) [...] at temperature 1, padded columns excluded from the
    normaliser (megatron's vocab_parallel_cross_entropy reads the global TP group and keeps
    them). A label outside every rank's slice (an ignored position) gives 0."""
    logp = log_softmax(logits, 1.0, group, vocab_size)
    local = logp.shape[-1]
    start = (0 if group is None else dist.get_rank(group)) * local
    here = (labels >= start) & (labels < start + local)
    index = torch.where(here, labels - start, torch.zeros_like(labels)).unsqueeze(-1)
    picked = logp.gather(-1, index).squeeze(-1).masked_fill(~here, 0.0)
    return -(picked if _world(group) == 1 else _SumOverGroup.apply(picked, group))


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kind: str,
    temperature: float,
    alpha: float,
    group=None,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ per-token loss over `loss_mask`, number of such tokens), per-token loss =
    alpha·T²·divergence + (1 − alpha)·cross entropy at T=1; the caller divides the sum by the
    global token count (the token mean over the global batch)."""
    mask = loss_mask.bool()
    per_token = torch.zeros(mask.shape, device=student_logits.device)
    if alpha > 0:
        div = divergence(student_logits, teacher_logits, kind, temperature, group, vocab_size)
        per_token = per_token + alpha * temperature**2 * div
    if alpha < 1:
        per_token = per_token + (1 - alpha) * cross_entropy(student_logits, labels, group, vocab_size)
    return torch.where(mask, per_token, 0.0).sum(), mask.sum()


__all__ = ["DIVERGENCES", "log_softmax", "divergence", "cross_entropy", "distill_loss"]
