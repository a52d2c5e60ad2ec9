"""Image-chat SFT of a vision-language model through the training entry point (one torchrun launch,
4 gloo processes), transformers and peft as the oracles.

A tiny Qwen2.5-VL with its processor (tests/vlm_processor.py), 24 one-image conversations made
into a chat dataset by `mbr data mode=chat`, three jobs on the transformers backend:
* `lora`: LoRA at tp2 (dp2), 6 steps, validation every 3: step 1 (B = 0: the base model) equals
  transformers' masked loss on the same conversations with their images, the loss falls, the
  adapter (on transformers' module names) loaded by peft onto the base equals the merged export,
  and the merged export's loss on the validation conversations (their images in the prompts) is the
  job's own last `val_loss`: the exported model computes what the trained one did;
* `full`: full fine-tune at tp2·pp2 (the vision tower on the first stage), 3 steps from the same
  batch: the same step-1 loss, a falling loss, an export transformers loads whose validation
  loss is the job's own (evaluated once, at the end);
* `frozen`: model.freeze=[vision] at tp2: the export's vision tower (but its patch merger, the
  projector) is the source's bit for bit, its language model is not;
* `packed`: a tiny LLaVA (positions the row's own, so packing is allowed) on the same conversations,
  packed (data.packing=true, two conversations a row) at tp2·dp2 with sequence parallelism: step 1 equals transformers' loss
  over the conversations of the global batch's rows, each alone with its own image, and the loss
  falls.
"""

import inspect
import math
from pathlib import Path

import pytest
import torch
import yaml

from megatron_bridge.backends.transformers.vision import TOKEN_TYPES
from megatron_bridge.testing import run_torchrun
from tests.vlm_processor import image_chats, make_llava, make_vlm

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
SEQ, SEED, GBS = 64, 1234, 4
PACKED_SEQ = 96  # two of the LLaVA conversations (47 tokens) share a row


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from megatron_bridge.commands.data import main

    root = tmp_path_factory.mktemp("vlm")
    model = make_vlm(root / "model")
    chats = image_chats(root / "data")
    llava = make_llava(root / "llava")
    for m, out in ((model, "img"), (llava, "llava")):
        assert main(["mode=chat", f"input={chats}", f"output={root / 'chat' / out}", f"tokenizer={m}",
                     f"max_length={SEQ + 1}"]) == 0  # fmt: skip
    return root, model, str(root / "chat" / "img"), llava, str(root / "chat" / "llava")


def reference(model_dir, prefix, conversations, seq: int = SEQ) -> float:
    """transformers' loss on `conversations`, each alone with its images: the masked token
    cross-entropies summed over them / their masked tokens (what data=sft's loss is)."""
    from transformers import AutoModelForImageTextToText

    from megatron_bridge.data.chat_dataset import ImageChatDataset

    ds = ImageChatDataset(prefix)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reads = [n for n in TOKEN_TYPES if n in inspect.signature(model.forward).parameters]
    total, count = 0.0, 0.0
    with torch.no_grad():
        for c in conversations:
            ids, mask, refs = ds[c]
            x = torch.from_numpy(ids[: seq + 1])[None]
            m = torch.from_numpy(mask[: seq + 1]).float()
            types = {n: torch.tensor(ds.processor().create_mm_token_type_ids(x[:, :-1].tolist())) for n in reads}
            logits = model(input_ids=x[:, :-1], **types, **ds.load_images(refs)).logits[0]
            ce = torch.nn.functional.cross_entropy(logits.float(), x[0, 1:], reduction="none")
            total += float((ce * m[1:]).sum())
            count += float(m[1:].sum())
    return total / count


def logits_of(model, ds, c):
    ids, _, refs = ds[c]
    x = torch.from_numpy(ids)[None]
    kinds = (x == model.config.image_token_id).long()
    with torch.no_grad():
        return model(input_ids=x, mm_token_type_ids=kinds, **ds.load_images(refs)).logits


def test_image_chat_sft_lora_full_and_frozen(setup, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from megatron_bridge.data.chat_dataset import ImageChatDataset
    from megatron_bridge.runtime.parity import load_dir
    from megatron_bridge.train.data.sft import SFTDataset, split_ranges

    root, model, prefix, llava, llava_prefix = setup
    ds = ImageChatDataset(prefix)
    split = yaml.safe_load(Path("conf/data/sft.yaml").read_text())["split"]  # data=sft's data.split
    train_r, valid_r, _ = split_ranges(len(ds), split)
    first = SFTDataset(ds, train_r, SEQ, packing=False, seed=SEED, num_samples=GBS)
    want = reference(model, prefix, [c for i in range(GBS) for c in first.conversations(i)])
    valid = SFTDataset(ds, valid_r, SEQ, packing=False, seed=SEED, num_samples=GBS)  # train.eval_iters=1 batch
    valid_chats = [c for i in range(GBS) for c in valid.conversations(i)]
    packed = SFTDataset(ImageChatDataset(llava_prefix), train_r, PACKED_SEQ, packing=True, seed=SEED, num_samples=GBS)
    packed_chats = [c for i in range(GBS) for c in packed.conversations(i)]
    assert len(packed_chats) > GBS  # rows of more than one conversation
    want_packed = reference(llava, llava_prefix, packed_chats, PACKED_SEQ)

    common = ",".join([
        "recipe=default", f"model.hf_path={model}", "model.backend=transformers", "data=sft", f"data.paths=[{prefix}]",
        f"data.tokenizer={model}", "data.packing=false", f"train.seq_length={SEQ}",
        f"train.seed={SEED}", "train.micro_batch_size=1", f"train.global_batch_size={GBS}", "optimizer.lr=1e-2",
        "optimizer.warmup_steps=1",
    ])  # fmt: skip
    packed_common = common.replace(str(model), str(llava)).replace(prefix, llava_prefix)
    packed_common = packed_common.replace("data.packing=false", "data.packing=true").replace(
        f"train.seq_length={SEQ}", f"train.seq_length={PACKED_SEQ}"
    )
    out = tmp_path / "out"
    jobs = [
        f"lora:{common},parallel.tp=2,peft=lora,train.steps=6,train.eval_interval=3,train.eval_iters=1,"
        f"export_adapter_to={out / 'adapter'},export_to={out / 'merged'}",
        f"full:{common},parallel.tp=2,parallel.pp=2,train.steps=3,train.eval_iters=1,export_to={out / 'full'}",
        f"frozen:{common},parallel.tp=2,train.steps=2,model.freeze=[vision],export_to={out / 'frozen'}",
        f"packed:{packed_common},parallel.tp=2,parallel.sequence_parallel=true,train.steps=3",
    ]
    res = run_torchrun([SCRIPT, str(tmp_path / "runs"), *jobs], nproc=4, timeout=900)[0]
    losses, val = res["losses"], res["val_losses"]
    for job in ("lora", "full", "frozen"):
        assert math.isclose(losses[job]["1"], want, rel_tol=1e-5), (job, losses[job]["1"], want)
    assert losses["lora"]["6"] < losses["lora"]["1"] and losses["full"]["3"] < losses["full"]["1"]
    assert math.isclose(losses["packed"]["1"], want_packed, rel_tol=1e-5), (losses["packed"]["1"], want_packed)
    assert losses["packed"]["3"] < losses["packed"]["1"]
    assert set(val["lora"]) == {"3", "6"} and all(math.isfinite(v) for v in val["lora"].values())

    # the exports load in transformers; the adapter on transformers' module names, in peft, is the merged model
    merged = AutoModelForImageTextToText.from_pretrained(str(out / "merged"), dtype=torch.float32).eval()
    base = AutoModelForImageTextToText.from_pretrained(str(model), dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    assert (logits_of(merged, ds, 0) - logits_of(peft, ds, 0)).abs().max() < 1e-5
    # each export's loss on the validation image chats is the trained job's own last val_loss
    for job, step, export in (("lora", "6", "merged"), ("full", "3", "full")):
        got = reference(out / export, prefix, valid_chats)
        assert math.isclose(got, val[job][step], rel_tol=1e-5), (job, got, val[job][step])

    src, frozen = load_dir(model), load_dir(out / "frozen")
    vision = [k for k in src if k.startswith("visual.") and not k.startswith("visual.merger.")]
    assert vision and all(torch.equal(src[k], frozen[k]) for k in vision)
    assert not all(torch.equal(src[k], frozen[k]) for k in src if k.startswith("visual.merger."))
    assert not all(torch.equal(src[k], frozen[k]) for k in src if k.startswith("model.layers."))
