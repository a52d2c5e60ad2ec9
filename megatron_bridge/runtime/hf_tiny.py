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

import contextlib
import functools
import inspect
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from megatron_bridge.backends.transformers.meta import class_name
from megatron_bridge.backends.transformers.plan import override
from megatron_bridge.backends.transformers.vision import image_text_class_name
from megatron_bridge.runtime.hf_tiny_configs import (
    FEATURES,
    HEADS,
    LAYERS,
    MAX_PARAMS,
    OVERRIDES,
    SIZES,
    VARIANTS,
    VOCAB,
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


def model_type_of(name: str) -> str:
    """The model type of an architecture name (a `VARIANTS` name: the model type it varies)."""
    return VARIANTS[name][0] if name in VARIANTS else name


def config_class(model_type: str) -> type[PretrainedConfig]:
    return CONFIG_MAPPING[model_type_of(model_type)]


def _fields(cls: type[PretrainedConfig]) -> set[str]:
    """The keyword fields of a config class (its dataclass fields)."""
    return {n for n, p in inspect.signature(cls).parameters.items() if p.kind is not p.VAR_KEYWORD}


def _get(cfg: PretrainedConfig, name: str) -> Any:
    """`cfg.name`, or None where the config holds it per layer (heterogeneous configs refuse a global read)."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _kinds(values: list[str] | None) -> list[str]:
    """The distinct values of a per-layer list, in order of first appearance."""
    return list(dict.fromkeys(values or []))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """transformers' logger silenced: default configs of some classes hold ids past their own vocabulary."""
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(level)


@functools.cache
def _modeling_source(model_type: str) -> str:
    mt = model_type_of(model_type)
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(mt) or MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[mt]
    model_cls = getattr(transformers, name)
    return inspect.getsource(inspect.getmodule(model_cls))  # type: ignore[arg-type]


def _generic(cls: type[PretrainedConfig], sources: tuple[str, ...]) -> dict[str, Any]:
    """The generic rule's fields for config class `cls` (sub-configs as nested dicts)."""
    have = _fields(cls)
    kw: dict[str, Any] = {k: v for k, v in {**SIZES, **FEATURES}.items() if k in have}
    kw.update({k: 0.0 for k in have if k.endswith(("dropout", "_pdrop", "jitter_noise"))})  # deterministic runs
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if name in have and isinstance(sub, type) and issubclass(sub, PretrainedConfig):
            kw[name] = _generic(sub, sources)
    if "kv_lora_rank" in have:  # multi-head latent attention: one latent for every head, rope part of head_dim
        kw.update(
            {k: v for k, v in (("num_key_value_heads", HEADS), ("head_dim", SIZES["qk_rope_head_dim"])) if k in have}
        )
    with _quiet():
        default = cls()
    if "use_sliding_window" in have:
        kw["use_sliding_window"] = True
    depth = _get(default, "num_hidden_layers")
    for field in sorted(have):  # per-layer kinds: those of the default config, cycled over the tiny depth
        values = _get(default, field)
        if not (isinstance(values, list) and len(values) == depth and all(isinstance(v, str) for v in values)):
            continue
        kinds = _kinds(values)
        if field == "layer_types" and kinds in (["full_attention"], ["sliding_attention"]) and "sliding_window" in have:
            if all(any(f'"{k}"' in src for src in sources) for k in ("sliding_attention", "full_attention")):
                kinds = ["sliding_attention", "full_attention"]
        if field == "mlp_layer_types" and kinds == ["sparse"] and any('"dense"' in src for src in sources):
            kinds = ["dense", "sparse"]  # all MoE by default, but the class builds dense layers too
        kw[field] = list(itertools.islice(itertools.cycle(kinds), LAYERS))
    vocab = kw.get("vocab_size", VOCAB)
    for name in sorted(have):  # token ids past the tiny vocabulary move into it
        value = _get(default, name) if name.endswith(("_token_id", "_token_index")) else None
        if isinstance(value, int) and value >= vocab:
            kw[name] = value % vocab
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocab for v in value):
            kw[name] = [v % vocab for v in value]
    return kw


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated with `extra`; a dict value updates a dict value (sub-configs) key by key."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def generic_fields(model_type: str) -> dict[str, Any]:
    """The generic rule's fields for `model_type` (before `OVERRIDES`); a VLM's with the VLM rule over them
    (runtime/hf_tiny_vlm.py)."""
    cls = config_class(model_type)
    sources = (_modeling_source(model_type), inspect.getsource(inspect.getmodule(cls)))  # type: ignore[arg-type]
    kw = _generic(cls, sources)
    if not is_vlm(model_type):
        return kw
    from megatron_bridge.runtime import hf_tiny_vlm  # the VLM rule builds on this module's text rule

    return hf_tiny_vlm.vlm_fields(model_type, kw, sources)


def is_vlm(model_type: str) -> bool:
    """Whether transformers builds `model_type` as an image-text-to-text model (a vision-language model)."""
    return model_type_of(model_type) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


@functools.cache
def _default(model_type: str) -> PretrainedConfig:
    with _quiet():
        return config_class(model_type)()


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
    model: torch.nn.Module, seed: int = 0, scale: float = 0.1, zero_scale: float = 0.02
) -> list[str]:
    """Perturb every parameter and persistent floating buffer whose values are all equal.

    A constant c ≠ 0 becomes c·(1 + scale·N(0, 1)) elementwise (norm weights of 1: 1 ± 0.1); a constant 0
    becomes zero_scale·N(0, 1) (biases, zero-initialised gates and routing-correction biases: small enough
    that every expert still gets tokens). Returns the names perturbed, in order."""
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
