"""How the transformers backend describes a vision-language model (backends/transformers/vision.py):
the language model's part of its config.json, the head arithmetic its own class's forward reads,
whether its LM head is tied, and its vision pieces' size for the planner."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.backends.transformers.meta import meta
from megatron_bridge.backends.transformers.vision import text_config_of
from megatron_bridge.bridge.hf_config import UnsupportedFeatures
from megatron_bridge.bridge.spec import BridgeSpec


def text_json(hf: Mapping[str, Any], cfg: Any) -> Mapping[str, Any]:
    """The language model's part of a config.json: a VLM's `text_config`, else all of it."""
    return hf.get("text_config") or {} if text_config_of(cfg) is not cfg else hf


def forward_source(class_name: str) -> str:
    """The source of transformers class `class_name`'s forward (what its head arithmetic reads)."""
    import inspect

    import transformers  # the core imports third-party packages only inside functions

    return inspect.getsource(getattr(transformers, class_name).forward)


def with_vision(spec: BridgeSpec, full: Any) -> BridgeSpec:
    """A VLM's description with its vision pieces' size (what the planner adds to the first
    stage): their parameters from the meta model, the patches of one image of the vision
    config's size (0 where it gives none: dynamic resolution), the tower's width·depth."""
    m = meta(spec)
    if m.refused:
        raise UnsupportedFeatures(
            f"{spec.architecture} cannot run on the transformers backend yet:\n"
            + "\n".join(f"  - {p}" for p in m.refused)
        )
    if not m.plan.vision:
        return spec
    n = sum(m.numel(k) for k in m.parameters if any(k == p or k.startswith(p + ".") for p in m.plan.vision))
    vision = getattr(full, "vision_config", None)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    patches = (size // patch) ** 2 if isinstance(size, int) and isinstance(patch, int) and patch else 0
    return spec.replace(vision_params=n, vision_patches=patches, vision_width=_tower_width(vision))


def _tower_width(vision: Any) -> int:
    """The vision tower's hidden size times its depth, from the names vision configs give them
    (0 where it gives neither: the planner then leaves the tower's activations and attention out)."""
    hidden = next(
        (v for k in ("hidden_size", "embed_dim", "width") if isinstance(v := getattr(vision, k, None), int)), 0
    )
    depth = next(
        (v for k in ("depth", "num_hidden_layers", "num_layers") if isinstance(v := getattr(vision, k, None), int)), 0
    )
    return hidden * depth


def tied(full: Any, text: Any) -> bool:
    """Whether the LM head is the embedding: a VLM's own config says so where it declares the
    field (Gemma 3's), else its language model's."""
    for c in (full, text):
        if "tie_word_embeddings" in c.to_dict():
            return bool(c.tie_word_embeddings)
    return bool(getattr(text, "tie_word_embeddings", False))


__all__ = ["forward_source", "text_json", "tied", "with_vision"]
