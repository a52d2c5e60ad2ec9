"""`objective=dpo` through the training entry point (one torchrun launch, 4 gloo processes).

16 pre-tokenized preference pairs made with `mbr data mode=preference` (chosen completions drawn
from the lower half of the vocabulary, rejected from the upper half, so a preference can be
learnt that holds on pairs the run never saw): the first 8 are the train split (one global batch
of 8 pairs), the last 8 the valid split. The policy and the reference are *different* tiny HF
Llamas. Jobs:
* `tp2` (tp2·dp2), `pp2` (pp2·dp2) and `hf_tp2` (tp2 on the transformers backend, the reference
  too): the step-1 loss equals TRL's `DPOTrainer.compute_loss` and the DPO formula computed with
  transformers (fp32), and the step-1 gradient norm the formula's; the loss falls over 6 steps,
  and the held-out pairs' DPO loss (`val_loss`) falls with it, their margins widening;
* `first3` + `resumed`: `tp2` stopped after 3 steps and resumed: bit-exact;
* `ds`: DeepSpeed ZeRO-2 at tp2·dp2: `tp2`'s step-1 loss (2e-5), then its losses within 2e-3 (the
  reduction order differs, and Adam at lr 2e-2 amplifies it);
* `packed`: tp2 with whole pairs packed into rows of 32 tokens (each sequence its own attention
  segment): step-1 loss and gradient norm = the formula's over the pairs those rows hold;
* `pre`: `tp2` with objective.precompute_reference=true (the reference run once over the train and
  valid pairs before training, then let go): `tp2`'s losses and val_losses;
* `lora`: peft=lora with objective.reference=null: the reference is the policy without its
  adapters, which at step 1 (B = 0) is the policy itself, so the loss is log 2 exactly; `lora_z3`:
  the same under DeepSpeed ZeRO-3 (dp4, the policy's weights partitioned);
* `moe`: a tiny Qwen3-MoE policy and a different one as reference at ep2 (dp4): step-1 loss and
  gradient norm = the formula's.
"""

import json
import math

import pytest

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun
from tests.dpo_oracle import dpo_loss, random_pairs, trl_dpo_loss

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
VOCAB, BETA, REL = 128, 0.1, 2e-5


def preference_pairs(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Pairs whose chosen completion uses ids below VOCAB/2 and rejected ids above it."""
    out = []
    for p in random_pairs(n, VOCAB // 2, seed):
        out.append({**p, "rejected_ids": [i + VOCAB // 2 for i in p["rejected_ids"]]})
    return out


def test_dpo_training_matches_trl_resumes_and_learns(tmp_path):
    from megatron_bridge.commands.data import main as data_main

    pairs = preference_pairs(16, seed=3)
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prefix = tmp_path / "pref" / "pairs"
    assert data_main(["mode=preference", f"input={src}", f"output={prefix}", f"vocab_size={VOCAB}"]) == 0

    policy = make_tiny("llama", tmp_path / "policy", seed=1, vocab_size=VOCAB)
    reference = make_tiny("llama", tmp_path / "reference", seed=2, vocab_size=VOCAB)
    moe_policy = make_tiny("qwen3_moe", tmp_path / "moe_policy", seed=1, vocab_size=VOCAB)
    moe_reference = make_tiny("qwen3_moe", tmp_path / "moe_reference", seed=2, vocab_size=VOCAB)
    ck, runs = tmp_path / "ckpt", tmp_path / "runs"

    def common(pol, ref, steps=6):
        ref_arg = f"objective.reference={ref}," if ref else ""
        return (
            f"recipe=default,model.hf_path={pol},objective=dpo,objective.beta={BETA},{ref_arg}data=preference,"
            f"data.paths=[{prefix}],data.split=50/50/0,train.steps={steps},train.seq_length=16,"
            "train.micro_batch_size=1,train.global_batch_size=8,optimizer.lr=2e-2,optimizer.warmup_steps=0"
        )

    base = common(policy, reference)
    tp2 = f"{base},parallel.tp=2"
    jobs = [
        f"tp2:{tp2},train.eval_iters=1,train.eval_interval=1",
        f"pp2:{base},parallel.pp=2",
        f"hf_tp2:{tp2},model.backend=transformers,train.steps=1",
        f"first3:{tp2},train.exit_after=3,checkpoint.dir={ck},checkpoint.save_interval=3",
        f"resumed:{tp2},checkpoint.dir={ck},checkpoint.resume=true",
        f"ds:{tp2},train.engine=deepspeed,zero.stage=2",
        f"packed:{tp2},data.packing=true,train.seq_length=32,train.steps=2",
        f"pre:{tp2},objective.precompute_reference=true,train.exit_after=3,train.eval_iters=1,train.eval_interval=1",
        f"lora:{common(policy, None, steps=3)},peft=lora,parallel.tp=2",
        f"lora_z3:{common(policy, None, steps=3)},peft=lora,train.engine=deepspeed,zero.stage=3",
        f"moe:{common(moe_policy, moe_reference, steps=1)},parallel.ep=2",
    ]
    out = run_torchrun([SCRIPT, str(runs), *jobs], nproc=4, timeout=900)[0]
    losses, val, grads = out["losses"], out["val_losses"], out["grad_norms"]

    train_pairs = pairs[:8]
    want, want_grad = dpo_loss(policy, reference, train_pairs, BETA)
    trl = trl_dpo_loss(policy, reference, train_pairs, BETA, tmp_path / "trl")
    assert abs(trl - want) <= 1e-5 * want, (trl, want)  # the two oracles agree
    for name in ("tp2", "pp2", "hf_tp2"):
        got = losses[name]["1"]
        assert abs(got - trl) <= 1e-5, (name, got, trl)
        assert abs(grads[name]["1"] - want_grad) <= 1e-4 * want_grad, (name, grads[name]["1"], want_grad)
    for name in ("tp2", "pp2"):
        assert losses[name]["6"] < losses[name]["1"], (name, losses[name])
    assert val["tp2"]["6"] < val["tp2"]["1"], val["tp2"]  # held-out pairs: the margin widened

    full = losses["tp2"]
    assert losses["first3"] == {k: full[k] for k in ("1", "2", "3")}
    assert losses["resumed"] == {k: full[k] for k in ("4", "5", "6")}  # bit-exact resume
    for step, value in losses["ds"].items():  # Adam at lr 2e-2 amplifies the reduction order's 1e-7s
        assert abs(value - full[step]) <= (REL if step == "1" else 2e-3) * abs(full[step]), (step, value, full[step])

    # packed rows of 32 tokens hold whole pairs (the next epoch's too): the formula over those pairs
    from megatron_bridge.train.data.preference import PreferenceDataset

    packed = PreferenceDataset(str(prefix), range(8), 32, seed=1234, num_samples=8, packing=True)
    held = [pairs[p] for i in range(8) for p in packed.pairs_of(i)]
    assert len(held) > 8  # really packed
    want_packed, grad_packed = dpo_loss(policy, reference, held, BETA)
    assert abs(losses["packed"]["1"] - want_packed) <= 1e-5 * want_packed, (losses["packed"], want_packed)
    assert abs(grads["packed"]["1"] - grad_packed) <= 1e-4 * grad_packed, (grads["packed"], grad_packed)
    for step, value in losses["pre"].items():  # the reference's log-probabilities computed up front
        assert abs(value - full[step]) <= 1e-6 * abs(full[step]), (step, value, full[step])
        assert abs(val["pre"][step] - val["tp2"][step]) <= 1e-6 * abs(val["tp2"][step]), step
    for name in ("lora", "lora_z3"):
        assert abs(losses[name]["1"] - math.log(2)) <= 1e-6, (name, losses[name])
        assert losses[name]["3"] < losses[name]["1"], (name, losses[name])

    want_moe, moe_grad = dpo_loss(moe_policy, moe_reference, train_pairs, BETA)
    assert abs(losses["moe"]["1"] - want_moe) <= 1e-5 * want_moe, (losses["moe"], want_moe)
    assert abs(grads["moe"]["1"] - moe_grad) <= 1e-4 * moe_grad, (grads["moe"], moe_grad)

    rows = [json.loads(line) for line in (runs / "tp2" / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    assert {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"} <= set(first)
    assert abs(first["rewards/margins"] - (first["rewards/chosen"] - first["rewards/rejected"])) <= 1e-9
    assert rows[-1]["rewards/margins"] > rows[0]["rewards/margins"]
