"""The vocab-parallel distillation math at tp=1, against torch's full-vocab functions and TRL's
generalized JSD as oracles: values, padded columns ignored, and gradients (autograd of the
oracle formula). tests/dist/test_vocab_parallel_tp2.py checks the same at tp=2."""

import os

import pytest
import torch
import torch.nn.functional as F

from megatron_bridge.runtime import vocab_parallel as vp

V, PAD = 11, 5  # real vocabulary, padded columns appended (megatron's padding)


@pytest.fixture(scope="module")
def trl_jsd():
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    return GKDTrainer.generalized_jsd_loss


def _logits(seed: int, shape=(3, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, V, generator=g) * 3


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x with PAD junk columns appended (large, so counting them would change every value)."""
    return torch.cat([x, torch.full((*x.shape[:-1], PAD), 50.0)], dim=-1)


def _oracle(kind: str, s: torch.Tensor, t: torch.Tensor, T: float, trl_jsd) -> torch.Tensor:
    ls, lt = torch.log_softmax(s / T, -1), torch.log_softmax(t / T, -1)
    if kind == "forward_kl":
        return F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    if kind == "reverse_kl":
        return F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    return trl_jsd(s, t, beta=0.5, temperature=T, reduction="none").sum(-1)


@pytest.mark.parametrize("T", [1.0, 2.5])
def test_log_softmax_matches_torch_and_ignores_padding(T):
    x = _logits(0)
    torch.testing.assert_close(vp.log_softmax(x, T), torch.log_softmax(x / T, -1))
    got = vp.log_softmax(_padded(x), T, vocab_size=V)
    torch.testing.assert_close(got[..., :V], torch.log_softmax(x / T, -1))
    assert torch.isneginf(got[..., V:]).all()  # probability 0


@pytest.mark.parametrize("kind", vp.DIVERGENCES)
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_divergence_matches_the_oracle_with_and_without_padding(kind, T, trl_jsd):
    s, t = _logits(1), _logits(2)
    want = _oracle(kind, s, t, T, trl_jsd)
    torch.testing.assert_close(vp.divergence(s, t, kind, T), want)
    torch.testing.assert_close(vp.divergence(_padded(s), _padded(t), kind, T, vocab_size=V), want)
    assert (vp.divergence(s, s, kind, T).abs() < 1e-6).all()  # zero between equal distributions


@pytest.mark.parametrize("kind", vp.DIVERGENCES)
def test_divergence_gradient_reaches_the_student_only(kind, trl_jsd):
    s, t = _logits(3), _logits(4)
    ref = s.clone().requires_grad_()
    (_oracle(kind, ref, t, 1.5, trl_jsd) * torch.arange(12.0).view(3, 4)).sum().backward()
    sp, tp = _padded(s).requires_grad_(), _padded(t).requires_grad_()
    (vp.divergence(sp, tp, kind, 1.5, vocab_size=V) * torch.arange(12.0).view(3, 4)).sum().backward()
    torch.testing.assert_close(sp.grad[..., :V], ref.grad)
    assert (sp.grad[..., V:] == 0).all()
    assert tp.grad is None  # the teacher is a constant


def test_cross_entropy_matches_torch_and_ignores_padding():
    x, labels = _logits(5), torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(5))
    want = F.cross_entropy(x.reshape(-1, V), labels.reshape(-1), reduction="none").view(3, 4)
    torch.testing.assert_close(vp.cross_entropy(x, labels), want)
    xp = _padded(x).requires_grad_()
    torch.testing.assert_close(vp.cross_entropy(xp, labels, vocab_size=V), want)
    ignored = labels.masked_fill(labels == labels[0, 0], -100)
    assert (vp.cross_entropy(x, ignored)[ignored == -100] == 0).all()


@pytest.mark.parametrize("kind", vp.DIVERGENCES)
@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_distill_loss_is_the_masked_sum_of_the_mixture(kind, alpha, trl_jsd):
    s, t, T = _logits(6), _logits(7), 2.0
    labels = torch.randint(0, V, (3, 4), generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 1, 1]])
    labels = labels.masked_fill(mask == 0, -100)
    ref = s.clone().requires_grad_()
    ce = F.cross_entropy(ref.reshape(-1, V), labels.reshape(-1), reduction="none", ignore_index=-100).view(3, 4)
    per = alpha * T**2 * _oracle(kind, ref, t, T, trl_jsd) + (1 - alpha) * ce
    want = per[mask.bool()].sum()
    want.backward()
    sp = _padded(s).requires_grad_()
    total, count = vp.distill_loss(sp, _padded(t), labels, mask, kind=kind, temperature=T, alpha=alpha, vocab_size=V)
    total.backward()
    torch.testing.assert_close(total, want)
    assert int(count) == 6  # the mask's ones
    torch.testing.assert_close(sp.grad[..., :V], ref.grad)
    assert (sp.grad[..., V:] == 0).all()


def test_unknown_divergence_is_refused():
    with pytest.raises(ValueError, match="forward_kl"):
        vp.divergence(_logits(0), _logits(1), "kl", 1.0)
