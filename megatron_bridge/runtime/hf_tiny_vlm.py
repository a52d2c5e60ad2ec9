"""The tiny-model rule for vision-language models (runtime/hf_tiny.py `generic_fields` applies it to every
model type `is_vlm` names, `vlm_architectures` lists those with a tp plan).

A VLM's config is composite: a text config, a vision config (and audio, resampler, VQ configs), and the
projector widths and token ids of its own. The text rule of hf_tiny.py reaches only the sub-configs whose
class the composite names; many name AutoConfig (LLaVA's Llama, Mistral-3's Mistral) and would stay full
size, and the rule's text sizes leave a vision tower 96 wide at its released image size (a tiny Gemma 3 of
93M parameters, SigLIP at 224 px). Here:

- the language model is the catalogue's tiny model of its own model type where that is a causal LM (its
  `OVERRIDES` included), else the text rule over its class: hidden 96, 4 heads, 2 KV heads, 4 layers,
  vocab 256, so tp2 splits it as it splits a causal LM; M-RoPE sections re-cut for the tiny head;
- every other sub-config (and those nested in it) gets `ENCODER_SIZES` over the text rule: 64 wide, 2
  layers of 4 heads, 32 px images of 8 px patches, outputs of the text hidden size;
- the composite's projector widths get `PROJECTOR_SIZES`;
- the image-side token ids (image, video, begin/end of image, ...) get distinct ids at the top of the tiny
  vocabulary, apart from the text config's pad/bos/eos;
- a sub-config starts from the keyword defaults the composite gives it (`sub_configs_defaults`: a
  LLaVA-OneVision SigLIP without its pooling head, Pixtral's GELU).

What the rule cannot guess is in hf_tiny_vlm_configs.py `VLM_OVERRIDES`, one line of reason each.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from megatron_bridge.runtime.hf_tiny_configs import LAYERS, OVERRIDES
from megatron_bridge.runtime.hf_tiny_rule import (
    _default,
    _fields,
    _generic,
    _get,
    _kinds,
    _merge,
    _quiet,
    config_class,
    text_fields,
)
from megatron_bridge.runtime.hf_tiny_vlm_configs import ENCODER_LAYERS, ENCODER_SIZES, FIRST_SPECIAL, PROJECTOR_SIZES


def _text_fields(sub: PretrainedConfig, kw: dict[str, Any]) -> dict[str, Any]:
    """A VLM's language model: the tiny config of its own model type where that is a causal LM (a VLM's
    Llama is the catalogue's tiny Llama, its overrides included), else the text rule over its class (`kw`)."""
    mt = sub.model_type
    if mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt in CONFIG_MAPPING:
        return _merge(text_fields(mt), OVERRIDES.get(mt, ("", {}))[1])
    return kw


def _encoder_fields(cls: type[PretrainedConfig], kw: dict[str, Any], extra: Any = ()) -> dict[str, Any]:
    """An encoder sub-config (and those nested in it): `ENCODER_SIZES` over the text rule's fields (and over
    the `extra` keywords its composite passes it), per-layer kinds cycled over the encoder's depth."""
    have = _fields(cls) | set(extra)
    out = {**kw, **{k: v for k, v in ENCODER_SIZES.items() if k in have}}
    for k, v in kw.items():
        if isinstance(v, list) and len(v) == LAYERS and all(isinstance(x, str) for x in v):
            out[k] = list(itertools.islice(itertools.cycle(_kinds(v)), ENCODER_LAYERS))
    for name, sub in (getattr(cls, "sub_configs", None) or {}).items():
        if name in have and isinstance(sub, type) and issubclass(sub, PretrainedConfig):
            out[name] = _encoder_fields(sub, kw.get(name, {}))
    return out


def _mrope(fields: dict[str, Any], text: PretrainedConfig) -> dict[str, Any]:
    """M-RoPE's (temporal, height, width) sections re-cut for the tiny head: they must sum to half the rotary
    width (head_dim x partial_rotary_factor), and the released sections are cut for a head of 128."""
    rope = dict(fields.get("rope_parameters") or _get(text, "rope_parameters") or {})
    if "rope_type" not in rope:  # rope parameters per layer kind: no one section to re-cut
        return fields
    heads = fields.get("num_attention_heads", text.num_attention_heads)
    head_dim = fields.get("head_dim") or fields.get("hidden_size", text.hidden_size) // heads
    half = int(head_dim * rope.get("partial_rotary_factor", fields.get("partial_rotary_factor", 1.0))) // 2
    return {**fields, "rope_parameters": {**rope, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}}


def _modeling_source_of(cls: type[PretrainedConfig]) -> str:
    """The source of the modeling file next to a config class's (GLM-4.6V's text model is GLM-4V's)."""
    return inspect.getsource(importlib.import_module(cls.__module__.replace(".configuration_", ".modeling_")))


def _token_id_fields(cls: type[PretrainedConfig]) -> list[str]:
    """The token-id fields of a config class, in its declaration order (the ids handed out follow it)."""
    return [n for n in inspect.signature(cls).parameters if n.endswith(("_token_id", "_token_index", "_token_ids"))]


def vlm_fields(model_type: str, kw: dict[str, Any], sources: tuple[str, ...]) -> dict[str, Any]:
    """A VLM's composite config: the language model by the text rule, every other sub-config (vision, audio,
    resampler) by `ENCODER_SIZES`, the projector widths by `PROJECTOR_SIZES`, and the image-side token ids
    distinct, inside the tiny vocabulary and apart from the text config's pad/bos/eos. A sub-config starts from
    the composite's own defaults for it (`sub_configs_defaults`' init kwargs: a SigLIP without its pooling head)."""
    cls, default = config_class(model_type), _default(model_type)
    have = _fields(cls)
    out = {**kw, **{k: v for k, v in PROJECTOR_SIZES.items() if k in have}}
    for name, spec in (getattr(cls, "sub_configs_defaults", None) or {}).items():
        sub = getattr(default, name, None)
        if sub is None and isinstance(spec.config_class, type) and issubclass(spec.config_class, PretrainedConfig):
            with _quiet():  # an optional encoder the default leaves out (Gemma 4 unified's vision): a VLM has it
                sub = spec.config_class(**spec.init_kwargs)
        if name not in have or not isinstance(sub, PretrainedConfig):
            continue
        own = kw.get(name) or _generic(type(sub), sources)  # an AutoConfig sub-config: the rule over its class
        if name == "text_config":
            fields = _text_fields(sub, own)
            mrope = any("mrope_section" in src for src in (*sources, _modeling_source_of(type(sub))))
            fields = _mrope(fields, sub) if mrope else fields
        else:
            fields = _encoder_fields(type(sub), own, spec.init_kwargs)
        out[name] = {**spec.init_kwargs, "model_type": sub.model_type, **fields}
    text = getattr(default, "text_config", None)
    taken: set[int] = set()
    for n in _token_id_fields(type(text)) if isinstance(text, PretrainedConfig) else []:
        v = out.get("text_config", {}).get(n, _get(text, n))
        taken.update(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, int))
    for n in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the composite's own text ids stay
        v = out.get(n, _get(default, n))
        taken.update(x for x in (v if isinstance(v, list) else [v]) if isinstance(x, int))
    free = (i for i in range(FIRST_SPECIAL, -1, -1) if i not in taken)
    for n in _token_id_fields(cls):
        v = _get(default, n)
        if n in ("pad_token_id", "bos_token_id", "eos_token_id") or (v is None and n.endswith("_ids")):
            continue
        # an id the default leaves None is the tokenizer's to say (MiniCPM-V's image token): the tiny model has one
        out[n] = [next(free) for _ in v] if isinstance(v, (list, tuple)) else next(free)
    return out


__all__ = ["vlm_fields"]
