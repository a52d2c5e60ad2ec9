"""A tiny vision-language model with its processor, and image chats for it: the demo's VLM step
(scripts/demo.sh) and the image-chat tests, built locally (no hub).

The processor: a Qwen2-VL-style image processor (patch 14, merge 2: an image of H x W pixels, resized
to multiples of 28, takes H·W/28² placeholder tokens) and a byte-level BPE tokenizer with ChatML and
vision special tokens, saved with `save_pretrained` so `AutoProcessor` loads it. Its class is
transformers' `PaddleOCRVLProcessor`, the image-only twin of `Qwen2VLProcessor` (same image
processor, same `<|image_pad|>` expansion): `Qwen2VLProcessor` also needs a video processor, which
needs torchvision, which the CPU machines do not have. The model (`make_vlm`): a random Qwen2.5-VL
that processor feeds, saved with it.

    python -m megatron_bridge.demo_vlm OUT                      # OUT/model (VLM + processor), OUT/data/chats.jsonl
    python -m megatron_bridge.demo_vlm answer HF_DIR IMAGE.png  # transformers answers about an image
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# Qwen2-VL's way of rendering parts: an image part is <|vision_start|><|image_pad|><|vision_end|>.
BODY = (
    "{% macro body(c) %}{% if c is string %}{{ c }}{% else %}{% for p in c %}{% if p.type == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}{% endmacro %}"
)
PROMPT = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
TEMPLATE = (
    BODY + "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ body(m.content) }}<|im_end|>\n{% endfor %}" + PROMPT
)
# The same with {% generation %} markers: transformers' return_assistant_tokens_mask is the oracle.
MARKED = (
    BODY + "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
    "{{ body(m.content) }}<|im_end|>\n{% endgeneration %}{% else %}{{ body(m.content) }}<|im_end|>\n{% endif %}"
    "{% endfor %}" + PROMPT
)
# Renders only the text parts: no image placeholder at all.
TEXT_ONLY_TEMPLATE = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "")
TEXT = ["what is in this picture? a red square and a blue circle, hello world"] * 10
PIXELS = 28  # one placeholder token per 28 x 28 pixels


def make_tokenizer(template: str = TEMPLATE, **roles: str):
    """The processors' tokenizer: byte-level BPE over `TEXT` with `SPECIALS`, `<|image_pad|>` its
    image token (`roles`: more named special tokens, e.g. boi_token="<|vision_start|>"), `template`
    its chat template (in memory; a processor saves it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", extra_special_tokens={"image_token": "<|image_pad|>", **roles}
    )
    hf.chat_template = template
    return hf


def make_processor(d: Path, template: str = TEMPLATE, max_pixels: int = 112 * 112) -> Path:
    from transformers.models.paddleocr_vl import PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(min_pixels=PIXELS * PIXELS, max_pixels=max_pixels)
    tokenizer = make_tokenizer(template)
    PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template).save_pretrained(
        str(d)
    )
    return d


def png(path: Path, w: int, h: int, color=(255, 0, 0)) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (w, h), color).save(path, format="PNG")
    return path


def png_bytes(w: int, h: int, color=(0, 0, 255)) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def make_vlm(d: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL that `make_processor`'s processor feeds (its vision tower takes the
    image processor's 14-pixel patches, 2 frames, merged 2x2; its vocabulary is the tokenizer's,
    the image placeholder `<|image_pad|>`), saved with that processor in the same directory: what a
    released VLM directory holds, for the image-chat training tests and the demo."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from megatron_bridge.runtime.hf_tiny import perturb_constants_  # torch: only where a model is built

    make_processor(d)
    tok = AutoTokenizer.from_pretrained(str(d))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = dict(
        hidden_size=96, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=len(tok), rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
        "mrope_section": [4, 4, 4]}, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], bos_token_id=None,
    )  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=96, fullatt_block_indexes=[1], window_size=56)  # fmt: skip
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        video_token_id=len(tok) - 1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).float()
    perturb_constants_(model, seed)
    model.save_pretrained(str(d))
    return d


def image_chats(d: Path, n: int = 24) -> Path:
    """`n` one-image conversations (PNG files beside the jsonl): the answer names the image's
    colour, so a model that learns from the pixels gets its loss down."""
    import json

    colours = {"red": (255, 0, 0), "blue": (0, 0, 255), "green": (0, 255, 0)}
    lines = []
    for i in range(n):
        name, rgb = list(colours.items())[i % len(colours)]
        png(d / "img" / f"{i}.png", 56, 56, rgb)
        user = {"role": "user", "content": [{"type": "image", "image": f"img/{i}.png"}, {"type": "text", "text": "what is in this picture?"}]}  # fmt: skip
        lines.append(json.dumps({"messages": [user, {"role": "assistant", "content": f"a {name} square"}]}))
    (d / "chats.jsonl").write_text("\n".join(lines) + "\n")
    return d / "chats.jsonl"


def answer(hf_dir: str | Path, image: str | Path, question: str = "what is in this picture?") -> str:
    """transformers' greedy answer of the VLM at `hf_dir` (an export: its processor beside it) to
    one image and a question, rendered with the processor's chat template."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    proc = AutoProcessor.from_pretrained(str(hf_dir))
    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    return proc.tokenizer.decode(out[0][enc["input_ids"].shape[1] :])


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "answer":  # python -m megatron_bridge.demo_vlm answer HF_DIR IMAGE
        print(f"answer:     {answer(sys.argv[2], sys.argv[3])!r}")
    else:
        out = Path(sys.argv[1])
        make_vlm(out / "model")
        print(
            f"wrote a tiny Qwen2.5-VL with its processor to {out / 'model'}; image chats: {image_chats(out / 'data')}"
        )
