"""Oracles of the DPO tests: TRL's own `DPOTrainer.compute_loss`, and the DPO formula computed with
transformers directly, on pre-tokenized pairs (prompt_ids, chosen_ids, rejected_ids)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch


def random_pairs(n: int, vocab: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """`n` pre-tokenized pairs of short random prompts and distinct completions (ids 2 … vocab−1)."""
    rng = random.Random(seed)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(rng.randrange(lo, hi))]

    out = []
    while len(out) < n:
        p = {"prompt_ids": ids(2, 6), "chosen_ids": ids(1, 8), "rejected_ids": ids(1, 8)}
        if p["chosen_ids"] != p["rejected_ids"]:
            out.append(p)
    return out


def completion_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log π(completion | prompt): the sum of the completion tokens' log-probabilities."""
    ids = torch.tensor([prompt + completion])
    logp = model(ids).logits[0, :-1].float().log_softmax(-1)
    tok = logp.gather(-1, ids[0, 1:, None])[:, 0]
    return tok[len(prompt) - 1 :].sum()


def dpo_loss(policy: str | Path, reference: str | Path, pairs, beta: float) -> tuple[float, float]:
    """(mean over pairs of −log σ(β·((log π(c) − log π_ref(c)) − (log π(r) − log π_ref(r)))), the
    norm of its gradient over the policy's parameters), with transformers' models in fp32."""
    from transformers import AutoModelForCausalLM

    pol, ref = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (policy, reference))
    total = torch.zeros(())
    for p in pairs:
        with torch.no_grad():
            r = [completion_logp(ref, p["prompt_ids"], p[k]) for k in ("chosen_ids", "rejected_ids")]
        s = [completion_logp(pol, p["prompt_ids"], p[k]) - r[i] for i, k in enumerate(("chosen_ids", "rejected_ids"))]
        total = total - torch.nn.functional.logsigmoid(beta * (s[0] - s[1]))
    loss = total / len(pairs)
    loss.backward()
    norm = math.sqrt(sum(float((q.grad.double() ** 2).sum()) for q in pol.parameters() if q.grad is not None))
    return float(loss), norm


def _word_tokenizer(vocab: int):
    """A tokenizer whose token i is the word `t{i}` (TRL's trainer wants one; the pairs are ids)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1")


def trl_dpo_loss(
    policy: str | Path, reference: str | Path, pairs, beta: float, out_dir: str | Path, loss_type: str = "sigmoid"
) -> float:
    """TRL's `DPOTrainer.compute_loss` on one batch of all `pairs` (its collator pads them, its
    loss is the mean over the batch), fp32 on CPU."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    pol, ref = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (policy, reference))
    vocab = pol.config.vocab_size
    args = DPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=len(pairs),
        beta=beta,
        loss_type=[loss_type],
        report_to=[],
        use_cpu=True,
        max_length=None,
        bf16=False,
    )
    placeholder = Dataset.from_list([{"prompt": "t2", "chosen": "t3", "rejected": "t4"}])  # the pairs come as ids
    trainer = DPOTrainer(
        model=pol, ref_model=ref, args=args, train_dataset=placeholder, processing_class=_word_tokenizer(vocab)
    )
    batch = trainer.data_collator([dict(p) for p in pairs])
    with torch.no_grad():
        return float(trainer.compute_loss(trainer.model, batch))
