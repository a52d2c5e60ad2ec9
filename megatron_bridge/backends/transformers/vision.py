"""Vision-language models on the transformers backend (torch-free): which class a config builds, and
what of it is the language model, the vision tower and the projector.

A VLM of transformers (`AutoModelForImageTextToText`: `Qwen2_5_VLForConditionalGeneration`,
`Gemma3ForConditionalGeneration`, ...) is a base model (`model`) holding a language model (its
`text_config`'s base model: `model.language_model`, Idefics' `model.text_model`), a vision tower and
a projector, and an LM head beside it. The language model is staged and split as a causal LM's base
model is (its text config's tp/pp plans, its path as the plan's prefix); the vision pieces are
kept whole on every TP rank of the first pipeline stage, where the base model's own forward runs
them and merges their features into the token embeddings (runtime/transformers/vision.py). Every TP
rank computes the same features from the same images and receives the same gradient for them
(layer 0's column-parallel input gradient is summed over TP), so their tensors are `replicated`.

Which of the vision pieces is the projector (for `model.freeze`) is declared by module name in
`PROJECTORS`: transformers names them per model, and a Qwen-style tower holds its patch merger.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from megatron_bridge.backends.transformers.kinds import PER_LAYER_INPUTS

# token types a VLM's forward reads (Gemma 3's bidirectional attention within an image; Qwen's
# M-RoPE positions), and where a config keeps its image placeholder's id
TOKEN_TYPES = ("token_type_ids", "mm_token_type_ids")
IMAGE_TOKEN = ("image_token_id", "image_token_index")
# what a VLM's forward hands its language model that the stages take from the capture: the
# embeddings, positions and masks; the rest must be None or one of `AFTER_LAYER`'s
TAKEN = ("inputs_embeds", "position_ids", "attention_mask")
IGNORED = (
    "input_ids",
    "past_key_values",
    "use_cache",
    "return_dict",
    "cache_position",
    "output_attentions",
    "output_hidden_states",
    "logits_to_keep",  # a causal LM's (Llama 4's language model): the stages keep every position
    "labels",
    "output_router_logits",  # the load-balancing loss is the config's (backends/transformers/aux.py)
    *TOKEN_TYPES,  # the VLM's own (positions, masks); a language model reading them names them
)
# keywords the language model's forward applies after its first layers: {keyword: (its partner,
# the language model's method)}; Qwen3-VL's deepstack adds vision features of earlier vision
# layers to the hidden states at the image tokens after decoder layer i (Qwen3VLTextModel.forward)
AFTER_LAYER = {"deepstack_visual_embeds": ("visual_pos_masks", "_deepstack_process")}
# keywords the language model's forward adds at the image tokens before decoder layer k, as
# {layer k: rows}: {keyword: its partner mask}. Granite-4-Vision's deepstack and spatial features
# (Granite4VisionTextModel.forward: the arithmetic of Qwen3-VL's `_deepstack_process`, inline)
BEFORE_LAYER = {"deepstack_features": "vision_mask"}
# keywords by which a VLM's forward hands its language model the token part of its per-layer
# inputs (kinds.PER_LAYER_INPUTS: Gemma 4's, image tokens looked up as padding); the first stage
# projects its merged embeddings onto them, as the language model's forward does
PER_LAYER_TOKENS = tuple(kw for _, kw, _ in PER_LAYER_INPUTS.values())


# keywords a language model's forward takes that every one does (what `TAKEN` and `IGNORED` cover,
# and the TransformersKwargs it passes down)
COMMON_INPUTS = (*TAKEN, *IGNORED, *PER_LAYER_TOKENS, "kwargs")


def language_refusals(forward_params: list[str], passes: tuple[str, ...]) -> list[str]:
    """What a VLM's language model's forward takes (its parameter names) that the stages do not
    pass on: not `COMMON_INPUTS`, `AFTER_LAYER` or its partner, or a layer input of its override
    (`passes`). Refused by describe, so that every rank refuses before any process group
    (a stage that never sees the keyword would otherwise wait on one that raised)."""
    partners = {p for p, _ in AFTER_LAYER.values()}
    known = {*COMMON_INPUTS, *AFTER_LAYER, *partners, *BEFORE_LAYER, *BEFORE_LAYER.values(), *passes}
    odd = [p for p in forward_params if p not in known]
    return (
        [f"its language model's forward takes {', '.join(odd)}, which the transformers backend's stages do not pass on"]
        if odd
        else []
    )


# module names (a base-model child, or a child of a vision tower) that project image features into
# the language model's width: what `model.freeze=[projector]` names
PROJECTORS = (
    "multi_modal_projector",
    "mm_projector",
    "connector",
    "merger",
    "aligner",
    "projector",
    "vision_projection",
    "vision_adapter",
    "resampler_model",
)
# what `model.freeze` may name of a VLM
FREEZE_GROUPS = ("vision", "projector", "language")


def image_text_class_name(model_type: str) -> str | None:
    """transformers' image-text-to-text class for `model_type`, None if it has none."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return None
    name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None


def builds_vlm(hf: Mapping[str, Any], causal: str | None) -> bool:
    """Whether this config.json is run as its VLM class: where the model type has one, and the
    config names it (`architectures`, as save_pretrained writes it) or no causal-LM class exists.
    A composite config naming the causal LM (or naming nothing, where one exists: llama4's) runs
    the text model alone, as `AutoModelForCausalLM.from_config` does."""
    vlm = image_text_class_name(str(hf.get("model_type", "")))
    if vlm is None:
        return False
    named = list(hf.get("architectures") or ())
    return vlm in named or causal is None or causal == vlm


def text_config_of(cfg: Any) -> Any:
    """The config the language model runs on: a VLM's text config, else `cfg` itself."""
    subs = getattr(cfg, "sub_configs", None) or {}
    return cfg.get_text_config() if "text_config" in subs and getattr(cfg, "text_config", None) is not None else cfg


def freeze_group(plan: Any, name: str) -> str:
    """The `model.freeze` group of tensor `name` of a model with `plan` (`plan.Plan`)."""
    if any(name == p or name.startswith(p + ".") for p in plan.projectors):
        return "projector"
    if any(name == p or name.startswith(p + ".") for p in plan.vision):
        return "vision"
    return "language"


@dataclass(frozen=True)
class VisionParts:
    """Where a built VLM keeps its pieces (paths in the model): `front` the module whose forward
    merges image features into the embeddings and calls its child `language` (the language
    model: a base model, or a causal LM with its own head: Llama 4's); `base` the path of the
    language model's base model, `head` its LM head's; `pieces` the front's other children with
    weights (vision tower, projector), `projectors` the projector modules (a piece, or a module
    inside one)."""

    front: str
    language: str
    base: str
    head: str
    pieces: tuple[str, ...]
    projectors: tuple[str, ...]
    image_positions: str = ""  # the front's method deriving positions from the images (IMAGE_POSITIONS)


# methods of a VLM's front that derive the token positions from the image grids (Qwen's M-RoPE:
# images take 2-D positions, the text after them continues past the image's extent); positions a
# sample's data cannot give restarting per conversation, so packing is refused for them (`packing_refusals`)
IMAGE_POSITIONS = ("get_rope_index", "compute_3d_position_ids", "get_vision_position_ids")


def vision_parts(model: Any) -> VisionParts | None:
    """The VLM layout of a built (meta or real) transformers model; None for a causal LM."""
    cfg = model.config
    if text_config_of(cfg) is cfg:
        return None
    front_name = model.base_model_prefix
    front = getattr(model, front_name, None)
    if front is None or front is model or not hasattr(front, "named_children"):  # Llama 4: the VLM's own forward
        front_name, front = "", model
    text_cls = type(text_config_of(cfg))
    text = [n for n, c in front.named_children() if type(getattr(c, "config", None)) is text_cls]
    if len(text) != 1:
        return None
    at = f"{front_name}.".lstrip(".")
    language = front.get_submodule(text[0])
    base, head = f"{at}{text[0]}", "lm_head"
    out = language.get_output_embeddings() if hasattr(language, "get_output_embeddings") else None
    if out is not None:  # a causal LM: its base model and head (Llama4ForCausalLM's prefix override: `model`)
        inner = next(n for n, c in language.named_children() if c is not out and hasattr(c, "layers"))
        head = f"{base}.{next(n for n, c in language.named_children() if c is out)}"
        base = f"{base}.{inner}"
    pieces = [f"{at}{name}" for name, _ in front.named_parameters(recurse=False)]  # LLaVA-OneVision's image_newline
    projectors: list[str] = []
    for name, child in front.named_children():
        if name == text[0] or not any(True for _ in child.parameters()):
            continue
        path = f"{at}{name}"
        pieces.append(path)
        if name in PROJECTORS:
            projectors.append(path)
            continue
        projectors += [f"{path}.{n}" for n, _ in child.named_children() if n in PROJECTORS]
    positions = next((m for m in IMAGE_POSITIONS if callable(getattr(front, m, None))), "")
    return VisionParts(front_name, text[0], base, head, tuple(pieces), tuple(projectors), positions)


# vision features a VLM adds to the hidden states after its first decoder layers, by the vision
# config's list naming them: Qwen3-VL's deepstack (one per entry of deepstack_visual_indexes, added
# after decoder layers 0, 1, ...; runtime/transformers/vision.py AFTER_LAYER). Only the first
# pipeline stage runs the vision tower, so those layers must be on it.
AFTER_LAYER_LISTS = ("deepstack_visual_indexes",)
# the config's lists of the decoder layers vision features are added before (BEFORE_LAYER):
# {key: where in an entry the layer is, None: the entry itself}; Granite-4-Vision's
# deepstack_layer_map of (vision layer, decoder layer) pairs and spatial_target_layers. At pp > 1
# their features travel from the first stage to the layer's, behind the hidden states
# (runtime/transformers/vision.py `Carried`).
BEFORE_LAYER_LISTS: dict[str, int | None] = {"deepstack_layer_map": 1, "spatial_target_layers": None}


def after_layer_count(cfg: Any) -> int:
    """How many of the first decoder layers take vision features after them (`AFTER_LAYER_LISTS`)."""
    vision = getattr(cfg, "vision_config", None)
    return max((len(getattr(vision, k, None) or ()) for k in AFTER_LAYER_LISTS), default=0)


def before_layers(cfg: Any) -> tuple[int, ...]:
    """The decoder layers a VLM's config adds vision features before (`BEFORE_LAYER_LISTS`), sorted."""
    found = {
        int(e if at is None else e[at]) for k, at in BEFORE_LAYER_LISTS.items() for e in getattr(cfg, k, None) or ()
    }
    return tuple(sorted(found))


def vision_limits(layout: Any, vision: tuple[str, ...], after_layers: int, num_layers: int) -> list[tuple[str, str]]:
    """(problem, fix) for what a VLM cannot run under `layout` (`after_layers`: `after_layer_count`)."""
    if not vision:
        return []
    out = []
    if layout.cp > 1:
        out.append(
            (
                f"context parallelism (cp={layout.cp}) over a vision-language model: its vision tower "
                f"({', '.join(vision)}) and the merge of image features into the token embeddings need the whole "
                "sequence on one rank",
                "set parallel.cp=1",
            )
        )
    first = layout.stage_layers(num_layers, 0, 0 if layout.vpp_or_1 > 1 else None) if layout.pp > 1 else None
    if first is not None and after_layers and not set(range(after_layers)) <= set(first):
        out.append(
            (
                f"the vision tower's features are added after decoder layers 0..{after_layers - 1} (deepstack), but "
                f"the first pipeline stage, which runs the vision tower, holds layers {first.start}..{first.stop - 1}",
                f"put at least {after_layers} layers on the first stage (parallel.layers_first_stage)",
            )
        )
    return out


__all__ = [
    "AFTER_LAYER",
    "AFTER_LAYER_LISTS",
    "BEFORE_LAYER",
    "BEFORE_LAYER_LISTS",
    "COMMON_INPUTS",
    "IGNORED",
    "IMAGE_POSITIONS",
    "IMAGE_TOKEN",
    "PER_LAYER_TOKENS",
    "TAKEN",
    "TOKEN_TYPES",
    "language_refusals",
    "FREEZE_GROUPS",
    "after_layer_count",
    "before_layers",
    "PROJECTORS",
    "VisionParts",
    "builds_vlm",
    "freeze_group",
    "image_text_class_name",
    "text_config_of",
    "vision_limits",
    "vision_parts",
]
