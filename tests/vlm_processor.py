"""The tiny vision-language processor, model and image chats of the image-chat tests and the bad-input
catalogue (megatron_bridge/demo_vlm.py, which the demo's VLM step uses too), and a tiny LLaVA with
its processor: a VLM whose positions are the row's own (no M-RoPE), for packed image chats."""

from pathlib import Path

from megatron_bridge.demo_vlm import (  # noqa: F401  (re-exported for the tests)
    MARKED,
    PIXELS,
    SPECIALS,
    TEMPLATE,
    TEXT_ONLY_TEMPLATE,
    image_chats,
    make_processor,
    make_tokenizer,
    make_vlm,
    png,
    png_bytes,
)


def make_llava(d: Path, seed: int = 0) -> Path:
    """The tiny LLaVA of runtime/hf_tiny.py (a CLIP tower of 32-pixel images in 8-pixel patches, Llama
    language model) on the demo tokenizer, saved with a `LlavaProcessor` (CLIP's image processor:
    every image resized and cropped to 32x32, 16 placeholder tokens, the tower's CLS feature
    dropped as the config's `vision_feature_select_strategy` says) in the same directory."""
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from megatron_bridge.runtime.hf_tiny import make_tiny, tiny_config

    tok = make_tokenizer()
    cfg = tiny_config("llava")
    side, patch = cfg.vision_config.image_size, cfg.vision_config.patch_size
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = {"vocab_size": len(tok), "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    make_tiny("llava", d, seed, image_text=True, image_token_index=ids["<|image_pad|>"], text_config=text)
    images = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=patch,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        num_additional_image_tokens=1,  # CLIP's CLS
        chat_template=TEMPLATE,
    ).save_pretrained(str(d))
    return d


# Gemma 3's processor expands each begin-of-image token into "\n\n" + begin + soft tokens + end + "\n\n":
# the template renders an image part as the begin token alone
BOI_TEMPLATE = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|>")


def make_gemma3(d: Path, seed: int = 0) -> Path:
    """The tiny Gemma 3 of runtime/hf_tiny.py (a SigLIP tower of 32-pixel images, its 16 patches pooled
    to 4 soft tokens; bidirectional attention within an image) on the demo tokenizer, saved with a
    `Gemma3Processor` (`<|vision_start|>`/`<|vision_end|>` its begin/end of image)."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    from megatron_bridge.runtime.hf_tiny import make_tiny, tiny_config

    tok = make_tokenizer(BOI_TEMPLATE, boi_token="<|vision_start|>", eoi_token="<|vision_end|>")
    cfg = tiny_config("gemma3")
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = {"vocab_size": len(tok), "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    make_tiny("gemma3", d, seed, image_text=True, image_token_index=ids["<|image_pad|>"], text_config=text,
              boi_token_index=ids["<|vision_start|>"], eoi_token_index=ids["<|vision_end|>"])  # fmt: skip
    side = cfg.vision_config.image_size
    Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": side, "width": side}),
        tokenizer=tok,
        chat_template=BOI_TEMPLATE,
        image_seq_length=cfg.mm_tokens_per_image,
    ).save_pretrained(str(d))
    return d
