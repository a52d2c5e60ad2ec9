"""A tiny vision-language processor built here, for the image-chat tests and the bad-input
catalogue: a Qwen2-VL-style image processor (patch 14, merge 2: an image of H x W pixels, resized
to multiples of 28, takes H·W/28² placeholder tokens) and a byte-level BPE tokenizer with
ChatML and vision special tokens, saved with `save_pretrained` so `AutoProcessor` loads it.

The processor class is transformers' `PaddleOCRVLProcessor`, the image-only twin of
`Qwen2VLProcessor` (same image processor, same `<|image_pad|>` expansion): `Qwen2VLProcessor`
also needs a video processor, which needs torchvision, which the CPU machines do not have.
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


def make_processor(d: Path, template: str = TEMPLATE, max_pixels: int = 112 * 112) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.paddleocr_vl import PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

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
        tokenizer_object=tok, eos_token="<|im_end|>", extra_special_tokens={"image_token": "<|image_pad|>"}
    )
    hf.chat_template = template
    image_processor = Qwen2VLImageProcessorPil(min_pixels=PIXELS * PIXELS, max_pixels=max_pixels)
    PaddleOCRVLProcessor(image_processor=image_processor, tokenizer=hf, chat_template=template).save_pretrained(str(d))
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
