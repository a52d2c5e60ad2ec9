"""The generic tiny-config rule of runtime/hf_tiny.py (one config class's fields, read off the class),
apart so that the VLM rule (runtime/hf_tiny_vlm.py) builds on it without importing hf_tiny, which
applies both."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Iterator
from typing import Any

import transformers
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
)

from megatron_bridge.runtime.hf_tiny_configs import FEATURES, HEADS, LAYERS, SIZES, VARIANTS, VOCAB


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


def is_vlm(model_type: str) -> bool:
    """Whether transformers builds `model_type` as an image-text-to-text model (a vision-language model)."""
    return model_type_of(model_type) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


@functools.cache
def _default(model_type: str) -> PretrainedConfig:
    with _quiet():
        return config_class(model_type)()


def text_fields(model_type: str) -> dict[str, Any]:
    """The generic rule's fields for `model_type`'s config class (before `OVERRIDES`; a VLM's sub-configs
    get it too, the VLM rule comes on top: runtime/hf_tiny.py `generic_fields`)."""
    cls = config_class(model_type)
    return _generic(cls, sources_of(model_type))


def sources_of(model_type: str) -> tuple[str, ...]:
    """The modeling and configuration source of `model_type`: what the rule looks for layer kinds in."""
    cls = config_class(model_type)
    return (_modeling_source(model_type), inspect.getsource(inspect.getmodule(cls)))  # type: ignore[arg-type]


__all__ = ["config_class", "is_vlm", "model_type_of", "sources_of", "text_fields"]
