"""Under torchrun (2 ranks, gloo): the vocab-parallel math with the vocabulary split over the
two ranks, every case in one launch. Both ranks draw the same full padded logits, keep their
slice, and report the inputs, the (replicated) outputs and their slice's gradient; the test
compares them with torch's full-vocab functions.

    torchrun --nproc-per-node 2 tests/dist/scripts/vocab_parallel.py
"""

import torch
import torch.distributed as dist

from megatron_bridge.parallel.dims import padded_vocab_size
from megatron_bridge.runtime import vocab_parallel as vp
from megatron_bridge.testing import report

T, ALPHA, DIVISIBLE = 2.0, 0.3, 4
VOCABS = (13, 3)  # padded to 16 (3 padded columns on rank 1) and to 8 (rank 1 holds padding only)


def cases(vocab: int, rank: int, tp: int) -> dict:
    g = torch.Generator().manual_seed(vocab)
    padded = padded_vocab_size(vocab, DIVISIBLE, tp)
    student, teacher = torch.randn(2, 3, padded, generator=g) * 3, torch.randn(2, 3, padded, generator=g) * 3
    labels = torch.randint(0, vocab, (2, 3), generator=g)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    weights = torch.arange(1.0, 7.0).view(2, 3)  # a non-uniform upstream gradient
    local = padded // tp
    cut = slice(rank * local, (rank + 1) * local)
    out = {"inputs": {"student": student.tolist(), "teacher": teacher.tolist(), "labels": labels.tolist()}}

    def run(name, fn):
        s = student[..., cut].clone().requires_grad_()
        t = teacher[..., cut].clone().requires_grad_()
        value = fn(s, t)
        (value * weights if value.dim() else value).sum().backward()
        out[name] = {"value": value.tolist(), "grad": s.grad.tolist(), "teacher_grad": t.grad is not None}

    group = dist.group.WORLD
    out["log_softmax"] = vp.log_softmax(student[..., cut], T, group, vocab)[..., : max(0, vocab - rank * local)].tolist()
    for kind in vp.DIVERGENCES:
        run(kind, lambda s, t, kind=kind: vp.divergence(s, t, kind, T, group, vocab))
        run(f"distill_{kind}", lambda s, t, kind=kind: vp.distill_loss(
            s, t, labels, mask, kind=kind, temperature=T, alpha=ALPHA, group=group, vocab_size=vocab
        )[0])
    run("cross_entropy", lambda s, t: vp.cross_entropy(s, labels, group, vocab))
    return out


dist.init_process_group("gloo")
rank, tp = dist.get_rank(), dist.get_world_size()
report({"rank": rank, "tp": tp, "vocabs": {str(v): cases(v, rank, tp) for v in VOCABS}})
dist.destroy_process_group()
