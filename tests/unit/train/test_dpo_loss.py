"""`objective=dpo`'s per-micro-batch loss against TRL's `DPOTrainer.compute_loss` (sigmoid, hinge,
ipo) on the same tiny models and pairs: the per-token cross entropies of the rows (chosen 2k,
rejected 2k+1, loss mask on the completion) computed with transformers, fed to `DPO.loss`."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_bridge.config.schema import DataConfig, ObjectiveConfig
from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.train.objectives.dpo import DPO, REF, sequence_logps
from tests.dpo_oracle import random_pairs, trl_dpo_loss

VOCAB, SEQ = 96, 16
PAIRS = DataConfig(kind="preference", packing=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    return make_tiny("llama", root / "p", seed=1, vocab_size=VOCAB), make_tiny(
        "llama", root / "r", seed=2, vocab_size=VOCAB
    )


def rows(pairs):
    """The micro-batch of `pairs` as the preference data gives it: shifted, padded to SEQ."""
    tokens, labels, mask = [], [], []
    for p in pairs:
        for k in ("chosen_ids", "rejected_ids"):
            ids = p["prompt_ids"] + p[k]
            m = [0] * len(p["prompt_ids"]) + [1] * len(p[k])
            pad = SEQ + 1 - len(ids)
            tokens.append(ids[:-1] + [0] * pad)
            labels.append(ids[1:] + [0] * pad)
            mask.append(m[1:] + [0] * pad)
    return {"tokens": torch.tensor(tokens), "labels": torch.tensor(labels), "loss_mask": torch.tensor(mask)}


def per_token_ce(hf_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")


@pytest.mark.parametrize("loss", ["sigmoid", "hinge", "ipo"])
def test_dpo_loss_equals_trl(models, tmp_path, loss):
    policy, reference = models
    pairs = random_pairs(4, VOCAB, seed=5)
    batch = rows(pairs)
    batch[REF] = sequence_logps(batch, per_token_ce(reference, batch))[0]
    obj = DPO(SimpleNamespace(data=PAIRS, objective=ObjectiveConfig(kind="dpo", beta=0.2, loss=loss)), None)
    total, n, report = obj.loss(batch, per_token_ce(policy, batch))
    got, metrics = obj.result(report.double())
    assert int(n) == 4 and abs(float(total) / 4 - got) < 1e-12
    want = trl_dpo_loss(policy, reference, pairs, 0.2, tmp_path, loss_type=loss)
    assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (loss, got, want)
    assert abs(metrics["rewards/margins"] - (metrics["rewards/chosen"] - metrics["rewards/rejected"])) < 1e-12
    assert 0.0 <= metrics["rewards/accuracies"] <= 1.0


def test_simpo_and_label_smoothing_follow_their_definitions(models):
    policy, _ = models
    pairs = random_pairs(3, VOCAB, seed=6)
    batch = rows(pairs)
    ce = per_token_ce(policy, batch)
    logp, n = sequence_logps(batch, ce)
    beta, gamma = 2.0, 0.3
    simpo = DPO(
        SimpleNamespace(data=PAIRS, objective=ObjectiveConfig(kind="dpo", beta=beta, loss="simpo", simpo_gamma=gamma)),
        None,
    )
    got = simpo.result(simpo.loss(batch, ce)[2].double())[0]
    avg = [float(logp[i] / n[i]) for i in range(6)]
    want = sum(-math.log(1 / (1 + math.exp(-(beta * (avg[2 * k] - avg[2 * k + 1]) - gamma)))) for k in range(3)) / 3
    assert abs(got - want) < 1e-6, (got, want)

    batch[REF] = torch.zeros(6)  # log π_ref = 0: Δ is the policy's own log-ratio
    eps = 0.2
    cdpo = DPO(SimpleNamespace(data=PAIRS, objective=ObjectiveConfig(kind="dpo", beta=0.5, label_smoothing=eps)), None)
    got = cdpo.result(cdpo.loss(batch, ce)[2].double())[0]
    d = [0.5 * float(logp[2 * k] - logp[2 * k + 1]) for k in range(3)]
    sig = [1 / (1 + math.exp(-x)) for x in d]
    want = sum(-(1 - eps) * math.log(s) - eps * math.log(1 - s) for s in sig) / 3
    assert abs(got - want) < 1e-6, (got, want)
