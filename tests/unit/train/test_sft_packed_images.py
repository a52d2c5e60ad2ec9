"""Packed image chats of VLMs whose positions are the row's own (no M-RoPE: LLaVA, and Gemma 3, whose
image tokens attend both ways), in one process (tp1, gloo), transformers as the oracle.

Image conversations of one and two images (distinct PNG files) made into a chat dataset by `mbr data
mode=chat`, packed by data=sft (train/data/sft.py), collated with their images and run through the
transformers backend's model as training runs it (runtime/packing.py `model_inputs`): every
conversation's per-token losses equal transformers' on that conversation alone with its own images,
and so does the gradient of the masked loss; the vision tower gets the micro-batch's images in the
order of their placeholders, and no row separates a conversation from its images. Cut into two
stages as pp2 cuts it, the later stage (no pixels) derives the same masks and losses. Two controls
show the comparison can fail: the same row with its images in another order, or without the
restarting positions (one long sequence), differ."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from megatron_bridge.backends.transformers.vision import TOKEN_TYPES
from megatron_bridge.runtime.parity import GRAD_RTOL, saved_grads
from tests.vlm_processor import make_gemma3, make_llava, png

SEQ = 140  # a 1-image conversation and a 2-image one share a row; two 2-image ones do not
SEED = 3  # a permutation whose rows mix 1- and 2-image conversations (asserted below)
TOL = 1e-5


def _user(*parts):
    return {"role": "user", "content": list(parts)}


def _chats(d):
    """Six conversations, alternately of one image and of two (the second over two user turns)."""
    colours = [(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 255, 0), (0, 255, 255), (255, 0, 255), (90, 40, 200)]
    lines, k = [], 0
    for i in range(6):
        n = 1 + i % 2
        files = [
            png(d / f"{k + j}.png", 40 + 7 * (k + j), 30 + 5 * j, colours[(k + j) % len(colours)]) for j in range(n)
        ]
        k += n
        first = [{"type": "image", "image": files[0].name}, {"type": "text", "text": "what is in this picture?"}]
        msgs = [_user(*first), {"role": "assistant", "content": f"a red square {i}"}]
        if n == 2:
            msgs += [_user({"type": "text", "text": "and?"}, {"type": "image", "image": files[1].name})]
            msgs += [{"role": "assistant", "content": "a blue circle"}]
        lines.append(json.dumps({"messages": msgs}))
    (d / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return d / "chats.jsonl"


@pytest.fixture(scope="module", params=["llava", "gemma3"])
def packed(request, tmp_path_factory):
    from megatron_bridge.commands.data import main
    from megatron_bridge.data.chat_dataset import ImageChatDataset
    from megatron_bridge.train.data.sft import SFTDataset

    root = tmp_path_factory.mktemp("packed_vlm")
    model = {"llava": make_llava, "gemma3": make_gemma3}[request.param](root / "model")
    chats = _chats(root / "data")
    assert main(["mode=chat", f"input={chats}", f"output={root / 'chat'}", f"tokenizer={model}"]) == 0
    ds = ImageChatDataset(root / "chat")
    return model, ds, SFTDataset(ds, range(len(ds)), SEQ, packing=True, seed=SEED)


def test_packed_rows_keep_each_conversation_with_its_images(packed):
    model, ds, sft = packed
    image_token = json.loads((model / "config.json").read_text())["image_token_index"]
    rows = [sft.conversations(i) for i in range(len(sft))]
    assert sorted(c for r in rows for c in r) == list(range(len(ds)))  # every conversation once, whole
    mixed = [r for r in rows if len(r) >= 2 and sorted(len(ds.images(c)) for c in r) == [1, 2]]
    assert mixed, rows  # a row of a 1-image and a 2-image conversation
    for i, convs in enumerate(rows):
        s = sft[i]
        assert s["image_refs"] == ds.images_of(convs)  # the row's images: its conversations', in order
        off, runs = 0, 0
        for k, c in enumerate(convs):
            n = int(sft._positions[c])
            assert torch.equal(s["tokens"][off : off + n], torch.from_numpy(ds[c][0][:n]))
            for ref in ds.images(c):  # each image's placeholders inside its own conversation's segment
                run = slice(off + ref.start, off + ref.start + ref.tokens)
                assert (s["segment_ids"][run] == k).all() and (s["tokens"][run] == image_token).any()
                runs += int((s["tokens"][run] == image_token).sum())
            off += n
        assert int((s["tokens"] == image_token).sum()) == runs  # no image token outside an image's run


def test_a_sample_whose_inputs_miss_an_image_placeholder_is_refused(packed):
    """A sample's inputs are tokens[:-1] of a conversation's first seq_length + 1: an image whose
    last placeholder is the last token kept (a label only) would leave the model a placeholder
    short of its features (transformers raises mid-step); it is refused naming max_length."""
    from megatron_bridge.errors import UserError
    from megatron_bridge.train.data.sft import SFTDataset

    _, ds, _ = packed
    c = next(c for c in range(len(ds)) if len(ds.images(c)) == 2)
    end = ds.images(c)[1].start + ds.images(c)[1].tokens
    with pytest.raises(
        UserError, match=rf"conversation {c} has an image at tokens .*\.\.{end - 1}, .*max_length={end}"
    ):
        SFTDataset(ds, [c], end - 1, packing=True, seed=SEED)[0]
    s = SFTDataset(ds, [c], end, packing=True, seed=SEED)[0]  # its last placeholder is input end - 1
    assert s["image_refs"] == ds.images(c) and torch.equal(s["tokens"], torch.from_numpy(ds[c][0][:end]))


def _reference(model_dir, ds, conversations):
    """transformers' per-token cross-entropy of each conversation alone, with its own images, and the
    gradient of their masked sum (keyed by checkpoint names: parity.saved_grads)."""
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    kinds = [n for n in TOKEN_TYPES if n in inspect.signature(hf.forward).parameters]
    out = []
    for c in conversations:
        ids, mask, refs = ds[c]
        ids = torch.from_numpy(ids[: SEQ + 1])
        x = ids[None, :-1]
        # the token types the processor gives these tokens (Gemma 3: its image tokens attend both ways)
        types = {n: torch.tensor(ds.processor().create_mm_token_type_ids(x.tolist())) for n in kinds}
        logits = hf(input_ids=x, **types, **ds.load_images(refs)).logits[0]
        ce = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none")
        (ce * torch.from_numpy(mask[1 : SEQ + 1]).float()).sum().backward()
        out.append(ce.detach())
    return out, saved_grads(hf)


def _built(model_dir):
    """(spec, the transformers backend's one-stage model at tp1 with the checkpoint loaded)."""
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import load_hf_weights

    spec = describe_hf(read_hf_config(model_dir), make_vocab_size_divisible_by=1, backend="transformers")
    (chunk,) = build_model(spec, Layout(), load_weights=True)
    load_hf_weights([chunk], spec, model_dir)
    return spec, chunk.eval()


def test_packed_image_chats_equal_transformers_per_conversation(packed, groups1):
    """One micro-batch of every packed row (flattened to one THD row, as training runs mbs > 1):
    each conversation's per-token losses are transformers' on it alone, and so is the gradient
    of the masked loss sum (the vision tower's included)."""
    from megatron_bridge.runtime.packing import model_inputs
    from megatron_bridge.runtime.weights import iter_hf_tensors
    from megatron_bridge.train.engine_base import loss_func

    model, ds, sft = packed
    spec, chunk = _built(model)
    fed: list[torch.Tensor] = []
    chunk.get_submodule("model.vision_tower").register_forward_pre_hook(
        lambda _, args, kw: fed.append((kw.get("pixel_values", args[0] if args else None)).clone()), with_kwargs=True
    )
    batch = sft.collate([sft[i] for i in range(len(sft))])
    convs = [c for i in range(len(sft)) for c in sft.conversations(i)]

    def run(b):
        args, kw = model_inputs(b)
        return chunk(*args, **kw).view(len(sft), SEQ)

    got = run(batch)
    total, count, _ = loss_func(batch["loss_mask"], got)
    total.backward()
    grads = dict(iter_hf_tensors([chunk], spec, value=lambda p: torch.zeros_like(p) if p.grad is None else p.grad))
    got = got.detach()
    want, want_grads = _reference(model, ds, convs)
    per_image = [ds.load_images([r])["pixel_values"] for c in convs for r in ds.images(c)]
    assert len(fed) == 1 and torch.equal(fed[0], torch.cat(per_image))  # the tower: every image, in order
    assert fed[0].shape[0] == sum(len(ds.images(c)) for c in convs)

    def per_conversation(losses):
        out = []
        for i in range(len(sft)):
            off = 0
            for c in sft.conversations(i):
                n = int(sft._positions[c])
                out.append(losses[i, off : off + n])
                off += n
        return out

    worst = max(float((a - b).abs().max()) for a, b in zip(per_conversation(got), want))
    assert worst < TOL, worst
    ref = torch.cat([w * torch.from_numpy(ds[c][1][1 : SEQ + 1]).float() for c, w in zip(convs, want)]).sum()
    assert abs(float(total - ref)) < TOL * int(count)
    assert set(grads) == set(want_grads) and any("vision_tower." in k and grads[k].abs().sum() > 0 for k in grads)
    over = max(float(((grads[k] - r).abs() - GRAD_RTOL * r.abs()).max()) for k, r in want_grads.items())
    assert over < TOL, over

    # controls: the images in another order, or a row without its restarts, are not transformers' answer
    with torch.no_grad():
        swapped = {**batch, "images": {"pixel_values": batch["images"]["pixel_values"].flip(0)}}
        assert max(float((a - b).abs().max()) for a, b in zip(per_conversation(run(swapped)), want)) > 1e-3
        flat = {**batch, "position_ids": torch.arange(len(sft) * SEQ).view(len(sft), SEQ)}
        assert max(float((a - b).abs().max()) for a, b in zip(per_conversation(run(flat)), want)) > 1e-3


def test_a_later_pipeline_stage_derives_the_packed_row_s_masks_without_pixels(packed, groups1):
    """The model cut into two stages (as pp2 cuts it, in one process): the second runs the VLM's
    forward on the ids and positions alone (no pixels: VisionFront.positions) for its masks, Gemma 3's
    image-bidirectional ones included, and its losses are the one-stage model's (transformers')."""
    from megatron_bridge.backends.transformers.backend import meta, model_plan, transformers_config
    from megatron_bridge.backends.transformers.meta import auto_class
    from megatron_bridge.backends.transformers.vision import text_config_of
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.packing import model_inputs
    from megatron_bridge.runtime.transformers import attention
    from megatron_bridge.runtime.transformers.build import Stage, transformer_config

    model, _, sft = packed
    spec, whole = _built(model)
    cfg, cpu = transformers_config(spec), torch.device("cpu")
    with torch.device("meta"):
        full = auto_class(cfg).from_config(cfg)
    text = text_config_of(full.config)
    text._attn_implementation = attention.implementation(text, cpu)
    n = spec.num_layers

    def stage(layers, pre, post):
        args = (spec, full, model_plan(full), meta(spec).kinds, transformer_config(spec, Layout()), cpu, True)
        return Stage(*args).chunk(layers, pre, post).eval()

    first, second = stage(range(0, n // 2), True, False), stage(range(n // 2, n), False, True)
    weights = whole.state_dict()
    for c in (first, second):
        missing = c.load_state_dict({k: v for k, v in weights.items() if k in c.state_dict()}, strict=False)
        assert not missing.unexpected_keys and missing.missing_keys in (
            [],
            [f"{c.plan.head}.weight"] * spec.tie_word_embeddings,
        )
    if spec.tie_word_embeddings:  # the last stage's copy of a tied embedding (megatron syncs it from the first's)
        with torch.no_grad():
            second.shared_embedding_or_output_weight().copy_(whole.shared_embedding_or_output_weight())
    args, kw = model_inputs(sft.collate([sft[i] for i in range(len(sft))]))
    with torch.no_grad():
        want = whole(*args, **kw)
        second.set_input_tensor(first(*args, **kw))
        got = second(*args, **kw)
    assert float((got - want).abs().max()) < TOL
