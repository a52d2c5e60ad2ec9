"""The vocab-parallel math at tp=2 (gloo, one launch): the values every rank reports and the
gradient slices the two ranks hold, against torch's full-vocab formulas (TRL's generalized
JSD for jsd) on the same padded logits cut to the real vocabulary."""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.dist

T, ALPHA = 2.0, 0.3  # as tests/dist/scripts/vocab_parallel.py
KINDS = ("forward_kl", "reverse_kl", "jsd")
WEIGHTS = torch.arange(1.0, 7.0).view(2, 3)
MASK = torch.tensor([[1, 0, 1], [1, 1, 0]])


@pytest.fixture(scope="module")
def results(torchrun):
    return torchrun(["tests/dist/scripts/vocab_parallel.py"], 2, timeout=120)


@pytest.fixture(scope="module")
def trl_jsd():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _divergence(kind, s, t, trl_jsd):
    ls, lt = torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1)
    if kind == "forward_kl":
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    return trl_jsd(s, t, beta=0.5, temperature=T, reduction="none").sum(-1)


def _oracles(inputs, vocab, trl_jsd):
    """name -> (value, gradient over the real columns) of the full-vocab formulas."""
    student = torch.tensor(inputs["student"])[..., :vocab]
    teacher = torch.tensor(inputs["teacher"])[..., :vocab]
    labels = torch.tensor(inputs["labels"])

    def ce(s):
        return F.cross_entropy(s.reshape(-1, vocab), labels.reshape(-1), reduction="none").view(2, 3)

    formulas = {"cross_entropy": lambda s: ce(s)}
    for kind in KINDS:
        formulas[kind] = lambda s, kind=kind: _divergence(kind, s, teacher, trl_jsd)
        formulas[f"distill_{kind}"] = lambda s, kind=kind: (
            (ALPHA * T**2 * _divergence(kind, s, teacher, trl_jsd) + (1 - ALPHA) * ce(s))[MASK.bool()].sum()
        )
    out = {}
    for name, fn in formulas.items():
        s = student.clone().requires_grad_()
        value = fn(s)
        (value * WEIGHTS if value.dim() else value).sum().backward()
        out[name] = (value.detach(), s.grad)
    return out, torch.log_softmax(student / T, -1)


def test_both_ranks_reported(results):
    assert [(r["rank"], r["tp"]) for r in results] == [(0, 2), (1, 2)]


@pytest.mark.parametrize("vocab", [13, 3])
def test_tp2_matches_the_full_vocab_formulas(results, vocab, trl_jsd):
    got = [r["vocabs"][str(vocab)] for r in results]
    oracles, log_probs = _oracles(got[0]["inputs"], vocab, trl_jsd)
    joined = torch.cat([torch.tensor(g["log_softmax"]).view(2, 3, -1) for g in got], dim=-1)
    torch.testing.assert_close(joined, log_probs)
    for name, (value, grad) in oracles.items():
        for g in got:  # every rank holds the same per-token values
            torch.testing.assert_close(torch.tensor(g[name]["value"]), value, msg=name)
            assert g[name]["teacher_grad"] is False, name
        full = torch.cat([torch.tensor(g[name]["grad"]) for g in got], dim=-1)
        torch.testing.assert_close(full[..., :vocab], grad, msg=name)
        assert (full[..., vocab:] == 0).all(), name  # padded columns get no gradient
