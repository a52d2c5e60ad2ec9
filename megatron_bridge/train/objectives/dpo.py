"""`objective=dpo`: direct preference optimisation on preference pairs (`data=preference`), with
TRL's losses and metrics.

A micro-batch holds its pairs as rows 2k (chosen) and 2k+1 (rejected). The log-probability of a
completion is the sum over its loss-masked tokens of log p(token | everything before it): minus
the per-token cross entropies the model already computes vocab-parallel, so no full-vocabulary
logits are gathered. The reference's come from a frozen forward pass over the same micro-batches
before the policy's (`prepare`), or — SimPO — not at all. With s(x) = log π(x) − log π_ref(x)
and Δ = s(chosen) − s(rejected), per pair:

- sigmoid: −(1−ε)·log σ(βΔ) − ε·log σ(−βΔ)  (ε = label_smoothing: conservative DPO; TRL's default at ε=0)
- hinge:   max(0, 1 − βΔ)
- ipo:     (s(c)/|c| − s(r)/|r| − 1/(2β))²  (TRL's length-normalised IPO)
- simpo:   −log σ(β·(log π(c)/|c| − log π(r)/|r|) − γ)  (no reference)

The logged loss is the mean over the global batch's pairs; rewards β·s (SimPO: β·log π/|x|), their
margin and the fraction of pairs whose chosen reward is higher are logged beside it (TRL's
rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.train.data.preference import PAIR, rows_per_sample
from megatron_bridge.train.objectives.base import Objective, token_losses
from megatron_bridge.train.objectives.frozen import FrozenPass

REF = "ref_logps"  # a micro-batch's reference log-probabilities, one per row


def sequence_logps(batch: dict[str, Any], output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π of each sequence's completion, its token count), from per-token cross entropies: one
    sequence per row, or — packed — per segment with a completion token, in order (`segment_ids`:
    the padded tails have none)."""
    mask = batch["loss_mask"].float()
    logp = -(output.float().view(mask.shape) * mask)
    seg = batch.get("segment_ids")
    if seg is None:
        return logp.sum(1), mask.sum(1)
    flat = (seg + torch.arange(seg.shape[0], device=seg.device)[:, None] * (int(seg.max()) + 1)).view(-1)
    n = int(flat.max()) + 1
    sums = logp.new_zeros(n).scatter_add(0, flat, logp.view(-1))
    counts = mask.new_zeros(n).scatter_add(0, flat, mask.view(-1))
    keep = counts > 0
    return sums[keep], counts[keep]


class DPO(Objective):
    report_size = 6  # loss, pairs, chosen reward, rejected reward, correct pairs, log π(chosen)

    def __init__(self, cfg: Any, reference: FrozenPass | None, table: torch.Tensor | None = None):
        """`reference`: the frozen model run before each global batch; `table` instead: every
        pair's (chosen, rejected) reference log-probabilities, computed once (`precompute`)."""
        self.o, self.reference, self.table = cfg.objective, reference, table
        self.rows_per_sample = rows_per_sample(cfg.data)
        self.reads_ahead = reference is not None or table is not None

    def prepare(self, batches):
        if self.table is not None:  # rows 2k, 2k+1 = pair k's chosen, rejected
            for b in batches:
                b[REF] = self.table[b[PAIR].long()].reshape(-1)
            return
        if self.reference is None:
            return
        got = self.reference.run(batches, self.forward, sequence_logps_only)
        for b, logps in zip(batches, got):  # last stage only: the loss runs there
            b[REF] = logps

    def loss(self, batch, output):
        o = self.o
        logps, lengths = sequence_logps(batch, output)
        if o.loss == "simpo":
            score = logps / lengths.clamp(min=1)
            sc, sr = score[0::2], score[1::2]
            per_pair = -F.logsigmoid(o.beta * (sc - sr) - o.simpo_gamma)
        else:
            ratio = logps - batch[REF].to(logps)
            sc, sr = ratio[0::2], ratio[1::2]
            delta = sc - sr
            if o.loss == "sigmoid":
                eps = o.label_smoothing
                per_pair = -(1 - eps) * F.logsigmoid(o.beta * delta) - eps * F.logsigmoid(-o.beta * delta)
            elif o.loss == "hinge":
                per_pair = torch.relu(1 - o.beta * delta)
            else:  # ipo
                n = lengths.clamp(min=1)
                per_pair = (sc / n[0::2] - sr / n[1::2] - 1 / (2 * o.beta)) ** 2
        total = per_pair.sum()
        rc, rr = (o.beta * sc).detach(), (o.beta * sr).detach()
        pairs = torch.tensor(float(per_pair.numel()), device=total.device)
        report = torch.stack(
            [total.detach().clone(), pairs, rc.sum(), rr.sum(), (rc > rr).float().sum(), logps[0::2].detach().sum()]
        )
        return total, pairs.to(torch.int), report

    def count(self, batch):
        return float(batch[PAIR].numel())

    def result(self, sums):
        n = float(sums[1].clamp(min=1))
        chosen, rejected = float(sums[2]) / n, float(sums[3]) / n
        return float(sums[0]) / n, {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "rewards/accuracies": float(sums[4]) / n,
            "logps/chosen": float(sums[5]) / n,
        }


def precompute(reference: FrozenPass, datasets: Sequence[Any], dims: Any) -> torch.Tensor:
    """`objective.precompute_reference=true`: the reference log-probabilities of every pair the
    `datasets` (train, valid) visit, [pairs, 2] (chosen, rejected), computed in one forward-only
    pass before training, the pairs shared out over the DP ranks and gathered back, so the reference
    model need not be held while training. Collective; the table is complete on last-stage ranks."""
    ids = sorted({p for d in datasets if d is not None for i in range(len(d)) for p in d.pairs_of(i)})
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = dims.micro_batch_size
    per_rank = -(-len(ids) // (dp * mbs * dims.pp)) * mbs * dims.pp  # whole micro-batches, a multiple of pp
    padded = ids + [ids[0]] * (per_rank * dp - len(ids))
    mine = padded[rank * per_rank : (rank + 1) * per_rank]
    source = next(d for d in datasets if d is not None)
    batches = [source.collate([source.sample_of([p]) for p in mine[k : k + mbs]]) for k in range(0, per_rank, mbs)]
    got = reference.run(batches, token_losses, sequence_logps_only)
    table = torch.zeros(max(ids) + 1, 2, dtype=torch.float32)
    if not got:  # not the last stage: the loss never reads the table here
        return table
    logps = torch.cat(got).float().view(-1, 2).to(comm_device())
    parts = [torch.empty_like(logps) for _ in range(dp)]
    torch.distributed.all_gather(parts, logps, group=ps.get_data_parallel_group())
    table[torch.tensor(padded)] = torch.cat(parts).cpu()
    return table


def sequence_logps_only(batch: dict[str, Any], output: torch.Tensor) -> torch.Tensor:
    return sequence_logps(batch, output)[0]


__all__ = ["DPO", "PAIR", "REF", "precompute", "sequence_logps"]
