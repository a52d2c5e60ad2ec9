"""Tiny models of every causal-LM architecture transformers ships with a tensor-parallel plan.

The catalogue the transformers backend's matrix runs over (issue 22, item 7). `architectures()` lists the
model types from the installed transformers itself: those of MODEL_FOR_CAUSAL_LM_MAPPING whose
config class declares `base_model_tp_plan` (100 in transformers 5.23) or that the transformers backend's
override table gives one (backends/transformers/overrides.py OVERRIDES: Falcon), and the `VARIANTS` of a model
type whose config flags switch its layout (Falcon's). `tiny_config(model_type)`
builds a config from that class by one generic rule, read off the class's own fields:

- sizes (`SIZES`): every size field the class has gets a small value. Hidden 96 with 4 attention
  heads and 2 KV heads of head_dim 40, so heads×head_dim (160) and kv×head_dim (80) differ from the
  hidden size and tp2 splits both; 4 layers; vocab 256; MoE with 4 experts, top-2, one dense layer
  first and one shared expert; MLA, indexer, linear-attention and Mamba widths to match; sliding
  windows, attention chunks and indexer top-k of 8 tokens (`WINDOW`: run sequences of 16 or more
  tokens for them to bite). Multi-head latent attention keeps one KV head per head and head_dim =
  the rope part, as the released configs do;
- features (`FEATURES`): optional parts several classes share are switched on where the class has
  the field: attention/MLP/projection biases, qk norms, qkv clipping, muP-style multipliers;
  dropouts and router jitter are 0 so runs are deterministic;
- layer kinds: every per-layer list of strings the default config holds (`layer_types`,
  `mlp_layer_types`, `indexer_types`, ...) becomes its kinds cycled over the 4 layers; a class
  whose default is all full (or all sliding) attention but whose modeling file knows both
  `sliding_attention` and `full_attention` gets the two alternating, and one whose MLPs are all
  `sparse` but whose modeling or configuration file knows `dense` gets dense and MoE alternating;
- composite configs (a text config with vision/audio configs) get the rule in every sub-config;
  token ids beyond the tiny vocabulary are moved into it.

What the rule cannot guess (a feature off by default, a pattern kept in another field, a size that
must divide another) is in `OVERRIDES`: the exception, one entry per architecture, each with a
one-line reason.

Vision-language models (`vlm_architectures()`: the image-text-to-text types whose text config has a tp
plan) get the same text rule in their language model and tiny encoders on top (runtime/hf_tiny_vlm.py,
its exceptions in `VLM_OVERRIDES`); `build_tiny` builds them with AutoModelForImageTextToText
(`auto_class`: Llama 4, which the causal-LM catalogue also lists, stays a causal LM unless asked).

`build_tiny` counts the parameters on the meta device first (a size the rule missed is refused,
not built), builds the model with transformers (fp32, CPU, deterministic for a seed) and perturbs
every weight the initialisation leaves constant (norm weights of 1, biases of 0, zero-initialised
gates, sinks and routing-correction biases) so a dropped or swapped tensor shows in the logits;
weights the initialisation draws at random are kept as drawn. `make_tiny` saves it with
`save_pretrained`. benchmarks/hf_arch_survey.py runs every architecture and writes
docs/hf_architectures.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from megatron_bridge.backends.transformers.meta import class_name
from megatron_bridge.backends.transformers.plan import override
from megatron_bridge.backends.transformers.vision import image_text_class_name
from megatron_bridge.runtime import hf_tiny_vlm
from megatron_bridge.runtime.hf_tiny_configs import (
    FEATURES,
    MAX_PARAMS,
    OVERRIDES,
    SIZES,
    VARIANTS,
)
from megatron_bridge.runtime.hf_tiny_rule import (  # re-exported: the catalogue's callers name this module
    _default,
    _merge,
    config_class,
    is_vlm,
    model_type_of,
    sources_of,
    text_fields,
)
from megatron_bridge.runtime.hf_tiny_vlm_configs import VLM_OVERRIDES


def architectures() -> list[str]:
    """Every causal-LM model type of the installed transformers with a tp plan (its config's, or
    the transformers backend's override for it), and the tiny variants of those."""
    types = [
        mt
        for mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if mt in CONFIG_MAPPING and (getattr(CONFIG_MAPPING[mt], "base_model_tp_plan", None) or override(mt).tp_plan)
    ]
    return sorted([*types, *(v for v, (mt, _, _) in VARIANTS.items() if mt in types)])


def generic_fields(model_type: str) -> dict[str, Any]:
    """The generic rule's fields for `model_type` (before `OVERRIDES`); a VLM's with the VLM rule over them
    (runtime/hf_tiny_vlm.py)."""
    kw = text_fields(model_type)
    return hf_tiny_vlm.vlm_fields(model_type, kw, sources_of(model_type)) if is_vlm(model_type) else kw


def vlm_architectures() -> list[str]:
    """Every image-text-to-text model type of the installed transformers whose config is composite with a text
    config that has a tp plan (its own `base_model_tp_plan`, or the transformers backend's override for it)."""
    out = []
    for mt in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        text = getattr(_default(mt), "text_config", None) if mt in CONFIG_MAPPING else None
        if isinstance(text, PretrainedConfig) and (text.base_model_tp_plan or override(text.model_type).tp_plan):
            out.append(mt)
    return sorted(out)


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """The tiny config of `model_type`: the generic rule (a VLM's: the VLM rule), then `OVERRIDES` (and
    `VLM_OVERRIDES`), then a variant's fields, then `overrides`."""
    kw = _merge(generic_fields(model_type), OVERRIDES.get(model_type_of(model_type), ("", {}))[1])
    kw = _merge(kw, VLM_OVERRIDES.get(model_type_of(model_type), ("", {}))[1])
    kw = _merge(kw, VARIANTS[model_type][2] if model_type in VARIANTS else {})
    return config_class(model_type)(**_merge(kw, overrides))


def perturb_constants_(
    model: torch.nn.Module, seed: int = 0, scale: float = 0.1, zero_scale: float = 0.02, bound: float = 100.0
) -> list[str]:
    """Perturb every parameter and persistent floating buffer whose values are all equal.

    A constant c ≠ 0 becomes c·(1 + scale·N(0, 1)) elementwise (norm weights of 1: 1 ± 0.1); a constant 0
    becomes zero_scale·N(0, 1) (biases, zero-initialised gates and routing-correction biases: small enough
    that every expert still gets tokens); an infinite one (a clamp bound that is no bound yet: Gemma 4's
    clipped linears) becomes ±bound·(1 + scale·N(0, 1)), finite as a released checkpoint's trained bounds
    are (c·(1 + noise) would be NaN). Returns the names perturbed, in order."""
    g = torch.Generator().manual_seed(seed)
    persistent = set(model.state_dict())
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    tensors += [(n, b) for n, b in model.named_buffers() if n in persistent and b.is_floating_point()]
    done = []
    with torch.no_grad():
        for name, t in sorted(tensors, key=lambda x: x[0]):
            if t.numel() == 0 or not t.is_floating_point():
                continue
            flat = t.detach().reshape(-1)
            if not bool((flat == flat[0]).all()):
                continue
            c = float(flat[0])
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
            if c in (float("inf"), float("-inf")):
                c = bound if c > 0 else -bound
            t.copy_(c + (scale * abs(c) if c else zero_scale) * noise)
            done.append(name)
    return done


def auto_class(model_type: str, image_text: bool | None = None) -> Any:
    """The auto class `build_tiny` builds `model_type` with: the class the transformers backend runs its
    config as (backends/transformers/meta.py `class_name`: the VLM where no causal LM exists or is the same
    class; Llama 4's causal LM, which its matrix runs), unless `image_text` says which."""
    if image_text is None:
        mt = model_type_of(model_type)
        image_text = is_vlm(mt) and class_name({"model_type": mt}) == image_text_class_name(mt)
    return AutoModelForImageTextToText if image_text else AutoModelForCausalLM


def build_tiny(model_type: str, seed: int = 0, *, image_text: bool | None = None, **overrides: Any) -> PreTrainedModel:
    """The tiny model of `model_type` in memory (fp32, CPU, as initialised: train mode), constants perturbed;
    built by `auto_class(model_type, image_text)`."""
    cfg = tiny_config(model_type, **overrides)
    auto = auto_class(model_type, image_text)
    with torch.device("meta"):  # a size the rule missed would build a full-size model: count first
        n = sum(p.numel() for p in auto.from_config(cfg).parameters())
    if n > MAX_PARAMS:
        raise ValueError(
            f"{model_type}: the tiny config builds {n:,} parameters (> {MAX_PARAMS:,}): a size field is not tiny"
        )
    torch.manual_seed(seed)
    model = auto.from_config(cfg, dtype=torch.float32)
    perturb_constants_(model, seed)
    return model


def make_tiny(
    model_type: str, out_dir: str | Path, seed: int = 0, *, image_text: bool | None = None, **overrides: Any
) -> Path:
    """Write the tiny model of `model_type` to `out_dir` with save_pretrained; returns the path."""
    model = build_tiny(model_type, seed, image_text=image_text, **overrides)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


__all__ = [
    "OVERRIDES",
    "FEATURES",
    "VARIANTS",
    "SIZES",
    "VLM_OVERRIDES",
    "architectures",
    "auto_class",
    "build_tiny",
    "config_class",
    "generic_fields",
    "is_vlm",
    "make_tiny",
    "model_type_of",
    "perturb_constants_",
    "tiny_config",
    "vlm_architectures",
]
