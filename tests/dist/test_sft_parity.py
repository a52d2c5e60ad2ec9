"""SFT (`data=sft`) under real torchrun/gloo against transformers, conversation by conversation.

The oracle: the tiny HF Llama's loss on the same conversations, each run alone and unpadded —
sum over conversations of the masked token cross-entropies / the number of masked tokens — and
the norm of that loss's gradient. The megatron run's step-1 loss and grad norm (before any
update) must equal them (fp32, 1e-5 / 1e-4 relative) for:

- packed samples at tp2·pp2 (2 packed rows per micro-batch, so the THD row crosses the pipeline)
  and at tp2·dp2 (DP ranks hold different numbers of assistant tokens: a mean of per-rank or
  per-micro-batch means would be off by far more than the tolerance), and DeepSpeed ZeRO-2·dp4;
- padded samples of exactly the conversations the packed batch holds (tp2·pp2): packed = padded;
- padded samples at cp2·dp2 (packing with cp>1 is refused by the sft-packing-cp rule);
- packed and padded samples on the transformers backend (transformers' modules, megatron's parallel
  linears) at tp2·pp2 (the packed rows' restarting positions give transformers' block-diagonal masks);
- `val_loss` of the packed tp2·dp2 run: the valid split's first global batch.
(lr=0: the weights stay the HF ones, the step still computes and reduces the gradients.)
"""

import math

import pytest
import torch

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
SEQ, SEED, GBS = 256, 1234, 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_bridge.commands.data import main
    from megatron_bridge.data.demo import CHAT_DEMO_PREFIX

    root = tmp_path_factory.mktemp("sft")
    args = ["mode=chat", "demo=true", f"output_dir={root / 'chat'}", "max_examples=60", "max_bytes=60000"]
    assert main([*args, "vocab_size=320"]) == 0
    return make_tiny("llama", root / "hf", vocab_size=320), str(root / "chat" / CHAT_DEMO_PREFIX)


def hf_reference(hf_dir, chat, conversations, *, grad=True):
    """(loss, grad norm) of the HF model: masked token CE summed over the conversations, one at
    a time and unpadded (truncated to SEQ+1 tokens as data=sft does), over their masked tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    total, count = torch.zeros((), dtype=torch.float32), 0.0
    with torch.set_grad_enabled(grad):
        for c in conversations:
            ids, mask = chat[c]
            ids, mask = torch.from_numpy(ids[: SEQ + 1]), torch.from_numpy(mask[: SEQ + 1]).float()
            logits = model(ids[None, :-1]).logits[0].float()
            ce = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
            total = total + (ce * mask[1:]).sum()
            count += float(mask[1:].sum())
        loss = total / count
    if not grad:
        return float(loss), None
    loss.backward()
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss), norm


def close(got, want, rel, what):
    assert abs(got - want) <= rel * abs(want), (what, want, got)


def test_sft_loss_matches_transformers_per_conversation(setup, tmp_path):
    from megatron_bridge.data.chat_dataset import ChatDataset
    from megatron_bridge.train.data.sft import SFTDataset, split_ranges

    hf, prefix = setup
    chat = ChatDataset(prefix)
    train_r, valid_r, _ = split_ranges(len(chat), "80,20,0")
    packed = SFTDataset(chat, train_r, SEQ, packing=True, seed=SEED, num_samples=GBS)
    convs = [c for i in range(GBS) for c in packed.conversations(i)]
    assert GBS < len(convs) and any(len(packed.conversations(i)) > 1 for i in range(GBS))  # really packed
    padded = SFTDataset(chat, train_r, SEQ, packing=False, seed=SEED, num_samples=len(convs))
    assert [padded.conversations(i)[0] for i in range(len(convs))] == convs  # the same conversations
    cp_convs = [padded.conversations(i)[0] for i in range(GBS)]
    valid = SFTDataset(chat, valid_r, SEQ, packing=True, seed=SEED, num_samples=GBS)
    valid_convs = [c for i in range(GBS) for c in valid.conversations(i)]

    common = [
        "recipe=default",
        f"model.hf_path={hf}",
        "train.steps=1",
        f"train.seq_length={SEQ}",
        f"train.seed={SEED}",
        "data=sft",
        f"data.paths=[{prefix}]",
        "data.split=80/20/0",
        "optimizer.lr=1e-30",
        "optimizer.min_lr=0",
        "optimizer.warmup_steps=0",
    ]

    def job(name, *overrides):
        return f"{name}:" + ",".join([*common, *overrides])

    gbs = f"train.global_batch_size={GBS}"
    jobs = [
        job("packed_tp2pp2", "parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2", gbs),
        job("packed_tp2dp2", "parallel.tp=2", "train.micro_batch_size=1", gbs, "train.eval_iters=1"),
        job("packed_ds_dp4", "train.engine=deepspeed", "zero.stage=2", "train.micro_batch_size=1", gbs),
        job(
            "padded_tp2pp2",
            "data.packing=false",
            "parallel.tp=2",
            "parallel.pp=2",
            "train.micro_batch_size=1",
            f"train.global_batch_size={len(convs)}",
        ),
        job("padded_cp2dp2", "data.packing=false", "parallel.cp=2", "train.micro_batch_size=1", gbs),
        job(
            "packed_hf_tp2pp2",
            "model.backend=transformers",
            "parallel.tp=2",
            "parallel.pp=2",
            "train.micro_batch_size=2",
            gbs,
        ),
        job(
            "padded_hf_tp2pp2",
            "model.backend=transformers",
            "data.packing=false",
            "parallel.tp=2",
            "parallel.pp=2",
            "train.micro_batch_size=1",
            f"train.global_batch_size={len(convs)}",
        ),
    ]
    res = run_torchrun([SCRIPT, str(tmp_path), *jobs], nproc=4, timeout=900)[0]
    losses, norms = res["losses"], res["grad_norms"]

    ref_loss, ref_norm = hf_reference(hf, chat, convs)
    for name in (
        "packed_tp2pp2",
        "packed_tp2dp2",
        "packed_ds_dp4",
        "padded_tp2pp2",
        "packed_hf_tp2pp2",
        "padded_hf_tp2pp2",
    ):
        close(losses[name]["1"], ref_loss, 1e-5, name)
        close(norms[name]["1"], ref_norm, 1e-4, name)
    cp_loss, cp_norm = hf_reference(hf, chat, cp_convs)
    close(losses["padded_cp2dp2"]["1"], cp_loss, 1e-5, "padded_cp2dp2")
    close(norms["padded_cp2dp2"]["1"], cp_norm, 1e-4, "padded_cp2dp2")
    # lr=0 keeps the HF weights, so the evaluation after step 1 sees them too
    close(res["val_losses"]["packed_tp2dp2"]["1"], hf_reference(hf, chat, valid_convs, grad=False)[0], 1e-5, "val")
