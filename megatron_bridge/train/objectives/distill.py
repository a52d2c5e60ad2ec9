"""`objective=distill`: knowledge distillation from a frozen teacher with the student's vocabulary.

The teacher runs forward-only under the student's own TP/PP/EP layout (it may be deeper or wider):
without pipeline parallelism right before the student on each micro-batch; with it, over the
step's micro-batches before the student's pass (its own pipeline schedule), its last stage keeping
each micro-batch's logits. Either way the logits stay sharded over TP along the vocabulary as they
come out of its output layer. The student
then returns its logits (labels withheld) and the loss is computed vocab-parallel from the two
shards (runtime/vocab_parallel.py) — no full-vocabulary logits are ever gathered:

    per token: alpha·T²·D(teacher_T, student_T) + (1 − alpha)·CE(student, label)

summed over the loss-masked tokens of the global batch and divided by their count (both terms
token means over the same tokens). D is `objective.divergence`: forward_kl = KL(teacher‖student),
reverse_kl = KL(student‖teacher), or jsd (TRL GKD's generalised Jensen-Shannon, β = 0.5).
Held teacher logits, in the training precision: micro_batch_size · seq_length · vocab/tp values,
times grad_accum with pp > 1 (`mbr plan` counts them).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.runtime.packing import model_inputs
from megatron_bridge.runtime.vocab_parallel import distill_loss
from megatron_bridge.train.objectives.base import Objective
from megatron_bridge.train.objectives.frozen import FrozenPass

TEACHER = "teacher_logits"  # a micro-batch's teacher logits (this TP rank's vocabulary shard)


def logits_forward(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """The model's logits [b, s, vocab/tp] (labels withheld from the forward)."""
    args, kwargs = model_inputs(batch)
    return model(*args, **{**kwargs, "labels": None})


class Distill(Objective):
    report_size = 4  # loss sum, tokens, divergence sum, cross-entropy sum

    def __init__(self, cfg: Any, teacher: FrozenPass, vocab_size: int, *, pipelined: bool):
        """`pipelined` (pp > 1): the teacher runs over the step's micro-batches first (its own
        pipeline pass); otherwise right before the student on each micro-batch, so only one
        micro-batch's teacher logits are ever held."""
        self.o, self.teacher, self.vocab_size = cfg.objective, teacher, vocab_size
        self.reads_ahead = pipelined

    def prepare(self, batches):
        got = self.teacher.run(batches, logits_forward, lambda b, logits: logits)  # training precision
        for b, logits in zip(batches, got):  # last stage only: the loss runs there
            b[TEACHER] = logits

    def forward(self, model, batch):
        if not self.reads_ahead:
            batch[TEACHER] = self.teacher.one(batch, logits_forward)
        return logits_forward(model, batch)

    def loss(self, batch, output):
        o, group = self.o, ps.get_tensor_model_parallel_group()
        labels, mask = batch["labels"], batch["loss_mask"]
        student, teacher = output.float().view(*labels.shape, -1), batch[TEACHER].view(*labels.shape, -1)
        kw = dict(kind=o.divergence, temperature=o.temperature, group=group, vocab_size=self.vocab_size)
        zero, n = student.new_zeros(()), mask.sum()
        div = distill_loss(student, teacher, labels, mask, alpha=1.0, **kw)[0] if o.alpha > 0 else zero  # T²·D
        ce = distill_loss(student, teacher, labels, mask, alpha=0.0, **kw)[0] if o.alpha < 1 else zero
        total = o.alpha * div + (1 - o.alpha) * ce
        report = torch.stack([total.detach().clone(), n.to(total.dtype), div.detach() / o.temperature**2, ce.detach()])
        return total, n.to(torch.int), report

    def result(self, sums):
        n = float(sums[1].clamp(min=1))
        return float(sums[0]) / n, {"distill/divergence": float(sums[2]) / n, "distill/ce": float(sums[3]) / n}


__all__ = ["TEACHER", "Distill", "logits_forward"]
