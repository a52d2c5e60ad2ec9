"""Rotary position embeddings, exactly as transformers computes them: the description.

This file reads the HF rope settings into the spec, writes them back and says what each
layer needs (`layer_rope`: own base, attention factor); runtime/blocks/rope.py holds the
inverse frequencies (equal to transformers' `ROPE_INIT_FUNCTIONS` for every rope type
accepted) and the megatron modules that apply them.

* Rope types: default, linear, llama3, yarn, longrope, dynamic. Frequencies that depend on
  the sequence length (longrope: short factors up to `original_max_position_embeddings`,
  long beyond; dynamic NTK: rescaled past `max_position_embeddings`) are chosen by the
  length megatron's `GPTModel` asks rotary for — the whole sequence under CP, the longest
  sequence of a packed (THD) batch — which is what transformers' `max(position_ids) + 1` is
  for the same batch. transformers' dynamic NTK keeps the longest length it has seen (a
  stateful cache); ours is stateless, so the two agree for any fixed sequence length and
  for every length <= max_position_embeddings, but not for a model fed growing then
  shrinking lengths above it.
* Attention factor (yarn's mscale, longrope's scaling): transformers multiplies cos and sin
  by it, i.e. scales the rotated part of q and k; `RopeSelfAttention` does exactly that
  (rotation is linear, so scaling before it is the same). megatron's own yarn path reads it
  from an MLA config only.
* Partial rotary (`partial_rotary_factor` -> `rotary_percent`): only the first
  rotary_percent·head_dim dims rotate (megatron slices by the frequency width).
* Interleaved rotary (GLM): pairs (2i, 2i+1) rotate; megatron's `rotary_interleaved`
  computes what transformers' Glm4 `apply_rotary_pos_emb` does. No HF key: a family sets it.
* Per-layer rope base (`rope_local_base`, Gemma 3): sliding-window layers use default rope
  with their own base; each such layer's `RopeSelfAttention` computes its own embedding of
  the same length, sliced per CP rank exactly as the model-wide one.
* NoPE layers (`nope_pattern`; HF `no_rope_layers`, where 1 means *use* rope): megatron's
  `no_rope_freq` list skips rotary in those layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.attention import layer_window
from megatron_bridge.bridge.features.base import Feature, register_feature
from megatron_bridge.bridge.registry import weight_family

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
_KEEP = {  # rope_parameters keys that matter per type (transformers' validators' lists)
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "longrope": ("short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"),
}
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
_LAYER_KINDS = ("full_attention", "sliding_attention")


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def read_rope(hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
    """rotary_base, rope_type, rope_params, rotary_percent, rope_local_base from
    transformers-5 `rope_parameters` (flat, or nested per layer type) or v4 `rope_scaling`."""
    raw = dict(hf.get("rope_parameters") or {})
    local: float | None = hf.get("rope_local_base_freq")
    if any(k in raw for k in _LAYER_KINDS):  # nested: {"full_attention": {...}, "sliding_attention": {...}}
        full, sliding = dict(raw.get("full_attention") or {}), raw.get("sliding_attention")
        if sliding and dict(sliding) != full:
            if (sliding.get("rope_type") or sliding.get("type") or "default") != "default":
                problems.append("a scaled rope type on sliding-window layers is not supported (only their base)")
            local = sliding.get("rope_theta", local)
        raw = full
    params = {**raw, **dict(hf.get("rope_scaling") or {})}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype in ("su", "yarn") and params.get("short_factor") is not None:  # Phi-3's old names for longrope
        rtype = "longrope"
    keep: dict[str, Any] = {}
    if rtype not in ROPE_TYPES:
        problems.append(f"rope_type {rtype!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    else:
        missing = [k for k in _REQUIRED.get(rtype, ()) if params.get(k) is None]
        if missing:
            problems.append(f"{rtype} rope scaling without {', '.join(map(repr, missing))}")
        keep = {k: _hashable(params[k]) for k in _KEEP[rtype] if params.get(k) is not None}
        if "original_max_position_embeddings" in _KEEP[rtype]:
            # transformers: a top-level value wins (Phi-3), else the rope dict's, else max_position_embeddings
            omax = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
            keep["original_max_position_embeddings"] = int(omax or hf.get("max_position_embeddings") or 2048)
    if params.get("mrope_section") is not None:
        problems.append("multimodal rope (mrope_section) is not supported")
    if params.get("llama_4_scaling_beta"):
        keep["llama_4_scaling_beta"] = float(params["llama_4_scaling_beta"])
    partial = hf.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    fields["rotary_percent"] = float(partial) if partial is not None else 1.0
    fields["rotary_base"], fields["rope_type"] = float(theta), rtype
    fields["rope_params"] = tuple(sorted(keep.items()))
    # sliding layers run *default* rope at their base: the same as the model's only when that is default too
    same = local is not None and float(local) == float(theta) and rtype == "default"
    fields["rope_local_base"] = float(local) if local is not None and not same else None


def read_nope(hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
    """`no_rope_layers` (SmolLM3, Llama 4): 1 = the layer *uses* rope, 0 = NoPE."""
    flags = hf.get("no_rope_layers")
    n = int(hf.get("num_hidden_layers") or 0)
    if flags is None:  # the family's reader may have set its own default (SmolLM3's interval)
        fields.setdefault("nope_pattern", ())
        return
    fields["nope_pattern"] = ()
    if len(flags) < n:
        problems.append(f"no_rope_layers has {len(flags)} entries for {n} layers")
        return
    pattern = tuple(0 if int(f) else 1 for f in list(flags)[:n])
    fields["nope_pattern"] = pattern if any(pattern) else ()


# ----------------------------------------------------------------------------------------
# rotary sizes and factors (the frequencies themselves: runtime/blocks/rope.py)
# ----------------------------------------------------------------------------------------


def rotary_dim(spec: Any) -> int:
    return int(spec.head_dim * spec.rotary_percent)


def attention_factor(spec: Any) -> float:
    """transformers' `attention_scaling` (cos and sin are multiplied by it)."""
    p = dict(spec.rope_params)
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if spec.rope_type == "yarn":

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        f = p["factor"]
        if p.get("mscale") and p.get("mscale_all_dim"):
            return float(mscale(f, p["mscale"]) / mscale(f, p["mscale_all_dim"]))
        return mscale(f)
    if spec.rope_type == "longrope":
        omax = p["original_max_position_embeddings"]
        f = p.get("factor") or spec.max_position_embeddings / omax
        return 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(omax))
    return 1.0


def layer_rope(spec: Any, index: int) -> dict[str, Any] | None:
    """What global layer `index` needs beyond the model-wide rotary embedding (None: nothing):
    {"base": own default-rope base or None, "scale": attention factor, "rot": rotary dims}."""
    if spec.nope_pattern and spec.nope_pattern[index]:
        return None
    local = spec.rope_local_base if spec.rope_local_base and layer_window(spec, index) is not None else None
    scale = 1.0 if local else attention_factor(spec)  # local layers: default rope, no scaling
    p = dict(spec.rope_params)
    beta = None if local else p.get("llama_4_scaling_beta")
    if local is None and scale == 1.0 and not beta:
        return None
    omax = p.get("original_max_position_embeddings")
    return {"base": local, "scale": scale, "rot": rotary_dim(spec), "beta": beta, "omax": omax}


@register_feature
class Rope(Feature):
    name = "rope"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        read_rope(hf, fields, problems)
        read_nope(hf, fields, problems)

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        rope = {"rope_theta": spec.rotary_base, "rope_type": spec.rope_type, **dict(spec.rope_params)}
        rope = {k: list(v) if isinstance(v, tuple) else v for k, v in rope.items()}
        if spec.rotary_percent != 1.0:
            rope["partial_rotary_factor"] = spec.rotary_percent
            cfg["partial_rotary_factor"] = spec.rotary_percent
        if "original_max_position_embeddings" in rope:
            cfg["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        if spec.rope_local_base:
            local = {"rope_type": "default", "rope_theta": spec.rope_local_base}
            cfg["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        else:
            cfg["rope_parameters"] = rope
        key = weight_family(spec.family).hf_names.get("nope_pattern")
        if spec.nope_pattern or key:
            pattern = spec.nope_pattern or (0,) * spec.num_layers
            cfg[key or "no_rope_layers"] = [0 if nope else 1 for nope in pattern]


__all__ = ["ROPE_TYPES", "Rope", "attention_factor", "layer_rope", "read_rope", "rotary_dim"]
