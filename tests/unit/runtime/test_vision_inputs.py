"""Tiny vision-language models (runtime/hf_tiny.py, hf_tiny_vlm.py) and their image batches and reference
(runtime/vision_inputs.py): one model per input format that matters most (Qwen-style patches with M-RoPE,
square SigLIP images with Gemma 3's token types, LLaVA-OneVision's any-resolution tiles, Idefics3 tiles)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from megatron_bridge.runtime import hf_tiny, vision_inputs
from megatron_bridge.runtime.parity import load_dir

SAMPLE = ["qwen2_5_vl", "gemma3", "llava_onevision", "idefics3"]


@pytest.fixture(scope="module", params=SAMPLE)
def built(request):
    return request.param, hf_tiny.build_tiny(request.param, image_text=True)


def _seq(model, model_type: str) -> int:
    n = vision_inputs.placeholder_count(model, vision_inputs.maker(model_type)(model.config, torch.Generator()))
    return max(32, n + 16)


def test_vlm_architectures_come_from_the_library_and_all_have_a_text_tp_plan():
    archs = hf_tiny.vlm_architectures()
    assert archs == sorted(archs) and len(archs) >= 60
    assert {"qwen2_5_vl", "qwen3_vl_moe", "gemma3", "llama4", "llava_onevision", "internvl", "mistral3"} <= set(archs)
    assert {"smolvlm", "idefics3", "glm4v"} <= set(archs)
    for name, (reason, fields) in hf_tiny.VLM_OVERRIDES.items():
        assert hf_tiny.is_vlm(name) and reason and "\n" not in reason and fields, name


@pytest.mark.parametrize("model_type", SAMPLE)
def test_tiny_vlm_keeps_the_text_rule_and_makes_the_encoder_tiny(model_type):
    cfg = hf_tiny.tiny_config(model_type)
    text = cfg.get_text_config()
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads, text.num_hidden_layers) == (
        96,
        4,
        2,
        4,
    )
    assert text.vocab_size == 256
    vc = cfg.vision_config
    assert vc.num_hidden_layers <= 2 and vc.hidden_size <= 96
    image = vision_inputs.image_token_id(cfg)
    assert 0 <= image < 256 and image not in {text.pad_token_id, text.bos_token_id, text.eos_token_id}
    assert hf_tiny.auto_class(model_type) is hf_tiny.AutoModelForImageTextToText


def test_llama4_stays_a_causal_lm_in_the_causal_catalogue():
    assert hf_tiny.auto_class("llama4") is hf_tiny.AutoModelForCausalLM
    assert hf_tiny.auto_class("llama4", image_text=True) is hf_tiny.AutoModelForImageTextToText


def test_batch_has_the_placeholders_the_vision_tower_gives_rows(built):
    model_type, model = built
    seq = _seq(model, model_type)
    ids, labels, images = vision_inputs.image_batch(model, 2, seq, seed=1)
    assert ids.shape == labels.shape == (2, seq) and len(images) == 2
    cfg = model.config
    image = vision_inputs.image_token_id(cfg)
    specials = vision_inputs.special_ids(cfg)
    for i in range(2):
        n = vision_inputs.placeholder_count(model, images[i])
        assert int((ids[i] == image).sum()) == n > 0
        assert ids[i, 0] not in specials and ids[i, -1] not in specials  # text around the image
        text = [t for t in ids[i].tolist() if t not in specials]
        assert len(text) == seq - n - len(vision_inputs.brackets(cfg))
    params = set(inspect.signature(model.forward).parameters)
    assert set(images[0]) <= params
    if model_type == "qwen2_5_vl":  # M-RoPE positions are computed only when the forward gets them
        assert set(images[0]) == {"pixel_values", "image_grid_thw", "mm_token_type_ids"}
        assert torch.equal(images[0]["mm_token_type_ids"][0], (ids[0] == image).long())
    if model_type == "gemma3":
        assert set(images[0]) == {"pixel_values", "token_type_ids"}
    again = vision_inputs.image_batch(model, 2, seq, seed=1)
    assert torch.equal(again[0], ids) and torch.equal(again[2][1]["pixel_values"], images[1]["pixel_values"])


def test_reference_gives_logits_loss_and_a_grad_for_every_saved_tensor(built, tmp_path):
    model_type, model = built
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids, labels, images = vision_inputs.image_batch(model, 2, _seq(model, model_type))
    ref = vision_inputs.reference(model, ids, labels, images)
    assert ref["logits"].shape == (*ids.shape, 256) and ref["logits"].dtype == torch.float32
    assert torch.isfinite(ref["logits"]).all() and math.isfinite(ref["loss"]) and ref["loss"] > 0
    model.save_pretrained(tmp_path)
    saved = load_dir(tmp_path)
    assert set(ref["grads"]) == set(saved)
    assert all(ref["grads"][k].shape == saved[k].shape for k in saved)
    nonzero = [k for k, g in ref["grads"].items() if g.abs().sum() > 0]
    vision = [k for k in nonzero if "vision" in k or "visual" in k]
    assert len(nonzero) >= 0.8 * len(saved) and vision
    # the model is as it was: weights unchanged (the grads went through save_pretrained and back)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # the loss is the mean over samples of each sample's own mean token cross-entropy
    with torch.no_grad():
        model.eval()
        per = [
            torch.nn.functional.cross_entropy(model(input_ids=ids[i : i + 1], **images[i]).logits[0].float(), labels[i])
            for i in range(2)
        ]
        model.train()
    assert ref["loss"] == pytest.approx(float(torch.stack(per).mean()), rel=1e-5)


def test_a_vision_config_without_image_size_takes_its_sub_config_s():
    """DeepSeek-OCR-2's vision config holds a SAM encoder and a Qwen2 encoder: the image side is the SAM's."""
    from megatron_bridge.runtime.vision_formats import square

    vc = hf_tiny.tiny_config("deepseek_ocr2").vision_config
    assert not hasattr(vc, "image_size") and vc.sam_config.image_size == 32
    assert square(hf_tiny.tiny_config("deepseek_ocr2"), torch.Generator()).keys() == {"pixel_values"}
    assert square(hf_tiny.tiny_config("deepseek_ocr2"), torch.Generator())["pixel_values"].shape == (1, 3, 32, 32)


@pytest.mark.parametrize(
    "model_type, keys",
    [
        ("cosmos3_omni", {"pixel_values", "image_grid_thw", "mm_token_type_ids"}),  # Qwen3-VL's patches
        ("deepseek_ocr2", {"pixel_values"}),
        ("janus", {"pixel_values"}),  # its aligner maps to the text width (hf_tiny_vlm_configs.VLM_OVERRIDES)
    ],
)
def test_the_image_made_for_a_tiny_vlm_runs_through_its_forward(model_type, keys):
    model = hf_tiny.build_tiny(model_type, image_text=True).eval()
    ids, _, images = vision_inputs.image_batch(model, 1, 32)
    assert set(images[0]) == keys
    n = vision_inputs.placeholder_count(model, images[0])
    assert int((ids[0] == vision_inputs.image_token_id(model.config)).sum()) == n > 0
    with torch.no_grad():
        logits = model(input_ids=ids, **images[0]).logits
    assert logits.shape == (*ids.shape, 256) and torch.isfinite(logits).all()
