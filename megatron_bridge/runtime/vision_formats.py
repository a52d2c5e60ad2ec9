"""Input makers for vision-language models (runtime/vision_inputs.py): one function per family of image
formats, each making the keyword arguments one random image takes in that family's forward, shaped from
the model's config alone (no processor), and `FORMATS`, the table of which model type uses which
(`square` where a type is not listed).

Each maker picks a small image that every merge, pooling or downsampling factor of its family divides,
and a grid that is not square where the format allows it, so a swapped height and width shows."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

Images = dict[str, torch.Tensor]
Maker = Callable[[PretrainedConfig, torch.Generator], Images]


def _pixels(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Random pixels in [-1, 1] (a normalised image's range)."""
    return torch.rand(shape, generator=g) * 2 - 1


def _side(size: Any) -> int:
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def _image_size(vc: PretrainedConfig) -> int:
    """The tower's image side: the vision config's `image_size`, else that of the first sub-config holding
    one (DeepSeek-OCR-2: its SAM encoder's, which sets the patch grid its position table is cut for)."""
    if getattr(vc, "image_size", None) is not None:
        return _side(vc.image_size)
    for name in getattr(vc, "sub_configs", None) or {}:
        sub = getattr(vc, name, None)
        if isinstance(sub, PretrainedConfig) and getattr(sub, "image_size", None) is not None:
            return _side(sub.image_size)
    raise ValueError(f"{type(vc).__name__} names no image_size, nor does any of its sub-configs")


def _channels(vc: PretrainedConfig) -> int:
    return int(getattr(vc, "num_channels", None) or getattr(vc, "in_channels", None) or 3)


def square(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """One image at the vision tower's size: pixel_values [1, C, S, S] (CLIP/SigLIP towers: LLaVA, Gemma 3,
    InternVL, Llama 4 as one tile)."""
    vc = cfg.vision_config
    s = _image_size(vc)
    return {"pixel_values": _pixels(g, 1, _channels(vc), s, s)}


def _merge_size(vc: PretrainedConfig) -> int:
    """How many patches per side one token merges (2 where the config does not say)."""
    for name in MERGE_FIELDS:
        v = getattr(vc, name, None)
        if v:
            return int(v[0] if isinstance(v, (list, tuple)) else v)
    return 2


def patches(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """Qwen-style flattened patches: pixel_values [t·h·w, C·T·P·P] and image_grid_thw [[t, h, w]], a grid of
    4x2 merge units (h ≠ w, so a swapped height and width shows)."""
    vc = cfg.vision_config
    p, m = vc.patch_size, _merge_size(vc)
    t = next((int(v) for n in TEMPORAL_FIELDS if (v := getattr(vc, n, None))), 1)
    h, w = 4 * m, 2 * m
    return {
        "pixel_values": _pixels(g, h * w, _channels(vc) * t * p * p),
        "image_grid_thw": torch.tensor([[1, h, w]]),
    }


def patch_stack(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """`patches` with each patch kept as an image: pixel_values [h·w, C, P, P] (PaddleOCR-VL)."""
    out = patches(cfg, g)
    p = cfg.vision_config.patch_size
    return {**out, "pixel_values": out["pixel_values"].reshape(-1, _channels(cfg.vision_config), p, p)}


def token_tiles(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """Patches gathered per image token: pixel_values [h·w, M·P, M·P, C] channels last, image_grid_thw
    [[1, h, w]] counted in tokens, 4x2 of them (Inkling 2)."""
    vc = cfg.vision_config
    side = vc.patch_size * _merge_size(vc)
    return {"pixel_values": _pixels(g, 8, side, side, _channels(vc)), "image_grid_thw": torch.tensor([[1, 4, 2]])}


def patches_hw(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """`patches` of one frame with a 2-D grid: pixel_values [h·w, C·P·P], image_grid_hw [[h, w]] (RADIO in
    Nemotron-H Omni)."""
    vc = cfg.vision_config
    m = _merge_size(vc)
    return {
        "pixel_values": _pixels(g, 8 * m * m, _channels(vc) * vc.patch_size**2),
        "image_grid_hw": torch.tensor([[4 * m, 2 * m]]),
    }


def positioned(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """Patches with their (x, y) positions: pixel_values [1, h·w, C·P·P] and image_position_ids [1, h·w, 2]
    for a grid of 4x2 pooling windows (Gemma 4)."""
    vc = cfg.vision_config
    k, p = getattr(vc, "pooling_kernel_size", None) or 1, getattr(vc, "model_patch_size", None) or vc.patch_size
    h, w = 4 * k, 2 * k
    ys, xs = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return {
        "pixel_values": torch.rand((1, h * w, _channels(vc) * p * p), generator=g),  # Gemma 4 maps [0, 1] itself
        "image_position_ids": torch.stack([xs.reshape(-1), ys.reshape(-1)], -1)[None],
    }


def strip(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """MiniCPM-V-style: an image's patches side by side in one strip, pixel_values [1, C, P, h·w·P], and its
    grid in patches, target_sizes [[h, w]] (8x4: two 2x2 merges leave 2x1 tokens)."""
    vc = cfg.vision_config
    p, h, w = vc.patch_size, 8, 4
    return {"pixel_values": _pixels(g, 1, _channels(vc), p, h * w * p), "target_sizes": torch.tensor([[h, w]])}


def square_hires(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """`square`, and the same image for the high-resolution tower (DeepSeek-VL hybrid)."""
    s = _side(cfg.high_res_vision_config.image_size)
    return {**square(cfg, g), "high_res_pixel_values": _pixels(g, 1, 3, s, s)}


def patches_merge_sizes(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """`patches` and the merge size of the image (image_merge_sizes [m]: VideoLLaMA3 merges per image)."""
    return {**patches(cfg, g), "image_merge_sizes": torch.tensor([_merge_size(cfg.vision_config)])}


def anyres(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """LLaVA-Next-style: an image of the first grid pinpoint's size, cut into tiles of the tower's size plus
    the downscaled whole: pixel_values [1, n, C, S, S] and image_sizes [[H, W]]."""
    vc = cfg.vision_config
    s = _side(vc.image_size)
    h, w = cfg.image_grid_pinpoints[0]
    n = image_size_to_num_patches((h, w), cfg.image_grid_pinpoints, s)
    return {"pixel_values": _pixels(g, 1, n, _channels(vc), s, s), "image_sizes": torch.tensor([[h, w]])}


def pixtral(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """Pixtral-style: one image at its own size, here the tower's size high and half as wide:
    pixel_values [1, C, H, W] and image_sizes [[H, W]]."""
    vc = cfg.vision_config
    h = _side(vc.image_size)
    return {"pixel_values": _pixels(g, 1, _channels(vc), h, h // 2), "image_sizes": torch.tensor([[h, h // 2]])}


def tiles(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """Idefics3-style: an image as 2 tiles of the tower's size, pixel_values [1, 2, C, S, S], with the
    pixel_attention_mask [1, 2, S, S] marking every pixel real."""
    vc = cfg.vision_config
    s = _side(vc.image_size)
    return {
        "pixel_values": _pixels(g, 1, 2, _channels(vc), s, s),
        "pixel_attention_mask": torch.ones(1, 2, s, s, dtype=torch.bool),
    }


# Where a vision config keeps how many patches per side a token merges, and how many frames a patch spans.
MERGE_FIELDS = ("spatial_merge_size", "merge_size", "merge_kernel_size", "adapter_merge_size")
TEMPORAL_FIELDS = ("temporal_patch_size", "patch_temporal")


def tiles_real(cfg: PretrainedConfig, g: torch.Generator) -> Images:
    """`tiles` with the mask per tile, pixel_attention_mask [1, 2] (Granite Docling: which tiles are real)."""
    return {**tiles(cfg, g), "pixel_attention_mask": torch.ones(1, 2, dtype=torch.bool)}


# The input maker of each model type whose format is not `square`.
_PATCHES = (
    "cohere_compass",
    "cosmos3_edge",
    "cosmos3_omni",
    "dots3_note",
    "ernie4_5_vl_moe",
    "minimax_m3_vl",
    "muse_glimmer",
    "muse_spark",
    "exaone4_5",
    "glm46v",
    "glm4v",
    "glm4v_moe",
    "glm5_next",
    "glm_ocr",
    "glmga",
    "hyperclovax_vision_v2",
    "qwen2_5_omni_thinker",
    "qwen2_5_vl",
    "qwen2_vl",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_omni_moe_thinker",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen4_exp",
)
FORMATS: dict[str, Maker] = {
    **dict.fromkeys(_PATCHES, patches),
    **dict.fromkeys(("paddleocr_vl", "kimi_k25"), patch_stack),
    "inkling2": token_tiles,
    "video_llama_3": patches_merge_sizes,
    "nemotron_h_omni": patches_hw,
    **dict.fromkeys(("gemma4", "gemma4_unified", "diffusion_gemma"), positioned),
    **dict.fromkeys(("minicpm_ocr", "minicpmv4_6", "minicpmv4_7"), strip),
    "deepseek_vl_hybrid": square_hires,
    **dict.fromkeys(("llava_next", "llava_next_video", "llava_onevision", "granite4_vision"), anyres),
    **dict.fromkeys(("mistral3", "mistral_large4", "lighton_ocr"), pixtral),
    **dict.fromkeys(("idefics2", "idefics3", "smolvlm"), tiles),
    "granite_docling": tiles_real,
}


def maker(model_type: str) -> Maker:
    return FORMATS.get(model_type, square)


__all__ = [
    "FORMATS",
    "Images",
    "MERGE_FIELDS",
    "Maker",
    "TEMPORAL_FIELDS",
    "anyres",
    "maker",
    "patch_stack",
    "patches",
    "patches_hw",
    "patches_merge_sizes",
    "pixtral",
    "positioned",
    "square",
    "square_hires",
    "strip",
    "tiles",
    "tiles_real",
    "token_tiles",
]
