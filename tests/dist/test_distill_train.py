"""`objective=distill` and `objective=lm` through the training entry point (one torchrun launch,
4 gloo processes), on 12 pre-tokenized labelled rows (`mbr data mode=chat` of {"input_ids",
"labels"} rows; the first 8, one global batch, are the train split) with a 2-layer student and a *deeper* (4-layer) teacher:

* `kd_tp2` (tp2·dp2: the teacher runs micro-batch by micro-batch beside the student) and `kd_pp2`
  (pp2·dp2: over the step's micro-batches first): with temperature 2 and alpha 1 the step-1 loss
  equals T² × the token-mean forward KL(teacher‖student) over the labelled tokens computed with
  transformers; the loss falls over 4 steps; `kd_packed` (tp2, rows packed, the teacher's
  attention confined to each row as the student's): the same over the rows its batch packs;
* `kd_first2` + `kd_resumed`: `kd_tp2` stopped after 2 steps and resumed: bit-exact;
* `kd_ds`: DeepSpeed ZeRO-2 at tp2·dp2: `kd_tp2`'s step-1 loss (2e-5), then its losses within 5e-4
  (the reduction order differs, and Adam at lr 1e-2 amplifies it);
* `kd_jsd`: alpha 0.5, divergence jsd, T=1.5: 0.5·T²·(TRL GKD's generalised JSD) + 0.5·CE;
* `kd_hf`: `kd_tp2` on the transformers backend (student and teacher): the same step-1 loss;
* `kd_lora`: peft=lora (B = 0 at step 1: the same loss), and learns;
* `kd_val`: `val_loss` (one step at lr 1e-12) = the formula over the 4 valid rows;
* `lm_tp2`: objective=lm on the same rows: step-1 loss = transformers' own loss (labels=…).
"""

import json
import random

import pytest
import torch

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
VOCAB, SEQ, REL = 128, 16, 2e-5


def labelled_rows(n: int, seed: int) -> list[dict[str, list[int]]]:
    """Rows of 6-16 random ids whose first 2-5 positions carry no loss (labels -100)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(2, VOCAB) for _ in range(rng.randrange(6, SEQ + 1))]
        k = rng.randrange(2, 6)
        out.append({"input_ids": ids, "labels": [-100] * k + ids[k:]})
    return out


def oracle(student, teacher, rows, *, temperature, alpha, divergence):
    """alpha·T²·(token-mean divergence) + (1 − alpha)·(token-mean CE) over the labelled tokens, each
    row alone and unpadded, with transformers' models in fp32."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    s_model, t_model = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (student, teacher))
    div_sum, ce_sum, count = 0.0, 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids, labels = torch.tensor([r["input_ids"]]), torch.tensor(r["labels"])
            s, t = s_model(ids).logits[0, :-1], t_model(ids).logits[0, :-1]
            target, keep = labels[1:], labels[1:] != -100
            s, t, target = s[keep], t[keep], target[keep]
            if divergence == "forward_kl":
                ls, lt = F.log_softmax(s / temperature, -1), F.log_softmax(t / temperature, -1)
                div = (lt.exp() * (lt - ls)).sum(-1)
            else:
                from trl.experimental.gkd.gkd_trainer import GKDTrainer

                div = GKDTrainer.generalized_jsd_loss(s[None], t[None], temperature=temperature, reduction="none")
                div = div.sum(-1)[0]
            div_sum += float(div.sum())
            ce_sum += float(F.cross_entropy(s, target, reduction="sum"))
            count += int(keep.sum())
    return alpha * temperature**2 * div_sum / count + (1 - alpha) * ce_sum / count


def hf_loss(student, rows) -> float:
    """transformers' own loss of the rows as one padded batch (labels -100 on the pads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32)
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.tensor([r["input_ids"] + [0] * (n - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (n - len(r["labels"])) for r in rows])
    attn = torch.tensor([[1] * len(r["input_ids"]) + [0] * (n - len(r["input_ids"])) for r in rows])
    with torch.no_grad():
        return float(model(ids, attention_mask=attn, labels=labels).loss)


def test_distillation_matches_the_formula_resumes_and_learns(tmp_path):
    from megatron_bridge.commands.data import main as data_main

    rows = labelled_rows(12, seed=4)  # 8 train rows (one global batch), 4 valid
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prefix = tmp_path / "chat" / "rows"
    assert data_main(["mode=chat", f"input={src}", f"output={prefix}", f"vocab_size={VOCAB}"]) == 0

    student = make_tiny("llama", tmp_path / "student", seed=1, vocab_size=VOCAB)
    teacher = make_tiny("llama", tmp_path / "teacher", seed=2, vocab_size=VOCAB, num_hidden_layers=4)
    ck, runs = tmp_path / "ckpt", tmp_path / "runs"
    data = (
        f"recipe=default,model.hf_path={student},data=sft,data.paths=[{prefix}],data.split=2/1/0,"
        f"train.seq_length={SEQ},train.micro_batch_size=1,train.global_batch_size=8,optimizer.lr=1e-2,"
        "optimizer.warmup_steps=0,data.packing=false"
    )
    kd = f"{data},objective=distill,objective.teacher={teacher},objective.temperature=2,objective.alpha=1,train.steps=4"
    tp2 = f"{kd},parallel.tp=2"
    jobs = [
        f"kd_tp2:{tp2}",
        f"kd_pp2:{kd},parallel.pp=2",
        f"kd_packed:{tp2},data.packing=true,train.steps=1",
        f"kd_first2:{tp2},train.exit_after=2,checkpoint.dir={ck},checkpoint.save_interval=2",
        f"kd_resumed:{tp2},checkpoint.dir={ck},checkpoint.resume=true",
        f"kd_ds:{tp2},train.engine=deepspeed,zero.stage=2",
        f"kd_jsd:{tp2},objective.alpha=0.5,objective.divergence=jsd,objective.temperature=1.5,train.steps=1",
        f"kd_hf:{tp2},model.backend=transformers,train.steps=1",
        f"kd_lora:{tp2},peft=lora,train.steps=2",
        f"kd_val:{tp2},train.steps=1,train.eval_iters=1,optimizer.lr=1e-12,optimizer.min_lr=0",
        f"lm_tp2:{data},parallel.tp=2,train.steps=1",
    ]
    out = run_torchrun([SCRIPT, str(runs), *jobs], nproc=4, timeout=900)[0]
    losses, val = out["losses"], out["val_losses"]

    train_rows = rows[:8]
    want = oracle(student, teacher, train_rows, temperature=2.0, alpha=1.0, divergence="forward_kl")
    for name in ("kd_tp2", "kd_pp2", "kd_hf", "kd_lora"):  # kd_lora at step 1: B = 0, the student itself
        assert abs(losses[name]["1"] - want) <= 1e-4 * want, (name, losses[name], want)
    # 8 packed samples hold more than the 8 rows (the next epoch's too): the oracle over those rows
    from megatron_bridge.data.chat_dataset import ChatDataset
    from megatron_bridge.train.data.sft import SFTDataset, split_ranges

    chat = ChatDataset(str(prefix))
    packed = SFTDataset(chat, split_ranges(len(chat), "2,1,0")[0], SEQ, packing=True, seed=1234, num_samples=8)
    held = [rows[c] for i in range(8) for c in packed.conversations(i)]
    assert len(held) > 8  # really packed
    want_packed = oracle(student, teacher, held, temperature=2.0, alpha=1.0, divergence="forward_kl")
    assert abs(losses["kd_packed"]["1"] - want_packed) <= 1e-4 * want_packed, (losses["kd_packed"], want_packed)
    assert losses["kd_tp2"]["4"] < losses["kd_tp2"]["1"], losses["kd_tp2"]
    assert losses["kd_pp2"]["4"] < losses["kd_pp2"]["1"], losses["kd_pp2"]
    full = losses["kd_tp2"]
    assert losses["kd_first2"] == {k: full[k] for k in ("1", "2")}
    assert losses["kd_resumed"] == {k: full[k] for k in ("3", "4")}  # bit-exact resume
    for step, value in losses["kd_ds"].items():  # Adam at lr 1e-2 amplifies the reduction order's 1e-7s
        assert abs(value - full[step]) <= (REL if step == "1" else 5e-4) * abs(full[step]), (step, value, full[step])
    assert losses["kd_lora"]["2"] < losses["kd_lora"]["1"], losses["kd_lora"]
    # validation (after a step at lr 1e-12): the loss over the 4 valid rows (a global batch reads each twice)
    want_val = oracle(student, teacher, rows[8:], temperature=2.0, alpha=1.0, divergence="forward_kl")
    assert abs(val["kd_val"]["1"] - want_val) <= 1e-4 * want_val, (val["kd_val"], want_val)
    jsd = oracle(student, teacher, train_rows, temperature=1.5, alpha=0.5, divergence="jsd")
    assert abs(losses["kd_jsd"]["1"] - jsd) <= 1e-4 * jsd, (losses["kd_jsd"], jsd)
    assert abs(losses["lm_tp2"]["1"] - hf_loss(student, train_rows)) <= 1e-5, losses["lm_tp2"]
