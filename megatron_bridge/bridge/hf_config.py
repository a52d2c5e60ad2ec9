"""HF `config.json` ⇄ `BridgeSpec` (megatron-core's TransformerConfig from it: runtime/tconfig.py).

`read_hf_config` is the one place a config.json is parsed. `spec_from_hf` reads the dict into
the spec and refuses, with every reason at once, the features the megatron local spec cannot
reproduce (o_proj bias, multimodal rope, ...): a silently dropped feature would give a model
that loads fine and computes something else. The common HF key names are `HF_KEYS`; the keys
a building block owns (rope scaling, windows, router details) are read by its feature
(`features/`), a family's own spellings by its class (`families/`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping as TMapping
from pathlib import Path
from typing import Any

from megatron_bridge.bridge.features.base import features
from megatron_bridge.bridge.registry import family_for, weight_family
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import UserError

# spec field <- the first HF key present (the names HF's configs share)
HF_KEYS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd"),
    "ffn_hidden_size": ("intermediate_size", "n_inner"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "num_query_groups": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "norm_epsilon": ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps"),
    "rotary_base": ("rope_theta",),
    "num_moe_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "moe_router_topk": ("num_experts_per_tok",),
    "moe_ffn_hidden_size": ("moe_intermediate_size",),
    "moe_shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
}


def read_hf_config(path: str | Path, *, arg: str = "model.hf_path") -> dict[str, Any]:
    """The parsed config.json of an HF model directory (or of the file itself). `arg` is how
    the user named the directory (`model.hf_path`, `src`), for the message."""
    p = Path(path)
    cfg_file = p / "config.json" if p.is_dir() else p
    if not cfg_file.is_file():
        raise UserError(
            f"{arg}={path}: no config.json there. Point {arg} at a Hugging Face model directory "
            "(what `save_pretrained` writes)."
        )
    try:
        data = json.loads(cfg_file.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise UserError(f"{cfg_file} is not valid JSON ({e}); re-export the model config.") from None
    bad = _nonfinite_keys(data)
    if bad:  # Python's json reads NaN/Infinity (and 1e999 as inf); a NaN eps compares false with every bound
        raise UserError(
            f"{cfg_file} holds non-finite numbers: {', '.join(bad[:5])}{' …' if len(bad) > 5 else ''}. "
            "Every number of a model config must be finite: fix the value (e.g. rms_norm_eps: 1e-6) or re-export "
            "the config."
        )
    return data


def _nonfinite_keys(obj: Any, prefix: str = "") -> list[str]:
    """`key: value` of every NaN or infinite number in a parsed JSON value (nested keys dotted)."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [f"{prefix or '(top)'}: {obj}"]
    if isinstance(obj, dict):
        return [b for k, v in obj.items() for b in _nonfinite_keys(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, list):
        return [b for i, v in enumerate(obj) for b in _nonfinite_keys(v, f"{prefix}[{i}]")]
    return []


# Sizes beyond any real model (the largest today are ~10x below each): a config.json or a
# manifest's hf_config naming more is refused before anything is allocated or looped over
# (`num_hidden_layers: 100000000` used to hang convert and grow export past 3.8 GB).
MANIFEST_NAME = "mbr_manifest.json"  # an `mbr convert` output's (convert/formats/manifest.py)
SIZE_LIMITS: dict[str, int] = {
    "num_layers": 10_000,
    "hidden_size": 1 << 18,
    "ffn_hidden_size": 1 << 20,
    "num_attention_heads": 1 << 14,
    "num_query_groups": 1 << 14,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 30,
    "num_moe_experts": 1 << 16,
    "moe_router_topk": 1 << 16,
    "moe_ffn_hidden_size": 1 << 20,
    "moe_shared_expert_intermediate_size": 1 << 20,
}


def _checked_size(key: str, field_name: str, v: Any) -> Any:
    """`v` as an int when it is a whole number within SIZE_LIMITS; UserError otherwise (lists,
    per-layer values some architectures use, pass through unchecked)."""
    if isinstance(v, list | dict) or field_name not in SIZE_LIMITS:
        return v
    limit = SIZE_LIMITS[field_name]
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not v.is_integer()):
        raise UserError(
            f'"{key}": {json.dumps(v)} in the model config (config.json, or hf_config in {MANIFEST_NAME}) is not '
            f'a whole number. Fix the file: write the number without quotes ("{key}": 4, not "{key}": "4").'
        )
    if not 0 <= v <= limit:
        raise UserError(
            f'"{key}": {json.dumps(v)} in the model config (config.json, or hf_config in {MANIFEST_NAME}) is '
            f"outside the sane range 0..{limit} for a model: the file is damaged or hand-edited. Fix the value "
            "(the checkpoint's tensors say what it should be)."
        )
    return int(v)


def base_fields(hf: TMapping[str, Any]) -> dict[str, Any]:
    """The common fields by `HF_KEYS` (absent keys stay absent); sizes checked (SIZE_LIMITS)."""
    out: dict[str, Any] = {}
    for field_name, keys in HF_KEYS.items():
        for k in keys:
            if hf.get(k) is not None:
                out[field_name] = _checked_size(k, field_name, hf[k])
                break
    rope = hf.get("rope_parameters") or {}
    if "rotary_base" not in out and rope.get("rope_theta") is not None:
        out["rotary_base"] = rope["rope_theta"]
    return out


# HF hidden_act -> BridgeSpec.activation (the GLU's gate activation); the first HF name is written back
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


# ----------------------------------------------------------------------------------------
# HF -> spec
# ----------------------------------------------------------------------------------------


class UnsupportedFeatures(UserError):
    """An HF config with features the bridge cannot reproduce (one line each in the message)."""


class MissingPackage(UnsupportedFeatures):
    """A model whose classes need a package that is not installed: the model is fine, the
    environment is not, so its fix (`fix`: the install) is its own."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def _moe_pattern(hf: TMapping[str, Any], n_layers: int) -> tuple[int, ...]:
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    pattern = tuple(0 if (i in dense or (i + 1) % step) else 1 for i in range(n_layers))
    return () if all(pattern) else pattern


def spec_from_hf(hf: TMapping[str, Any], *, make_vocab_size_divisible_by: int = 128) -> BridgeSpec:
    """Build (and validate) the spec of an HF config dict. Raises UserError listing every
    unsupported feature."""
    family = family_for(hf)
    hf = family.complete_hf(hf)
    base = base_fields(hf)
    problems: list[str] = []
    f: dict[str, Any] = {}
    f["family"] = family.name
    f["architecture"] = (hf.get("architectures") or family.architectures)[0]
    missing = [
        k
        for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size")
        if base.get(k) is None
    ]
    if missing:
        raise UserError(
            f"config.json lacks {', '.join(missing)} (HF names: {', '.join(HF_KEYS[k][0] for k in missing)})"
        )
    for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size"):
        f[k] = base[k]
    if base.get("max_position_embeddings") is not None:
        f["max_position_embeddings"] = base["max_position_embeddings"]
    f["norm_epsilon"] = float(base.get("norm_epsilon", 1e-5))
    heads = base["num_attention_heads"]
    f["num_query_groups"] = int(base.get("num_query_groups") or heads)
    f["head_dim"] = int(base.get("head_dim") or base["hidden_size"] // heads)
    f["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    f["attention_dropout"] = float(hf.get("attention_dropout") or 0.0)
    f["initializer_range"] = float(hf.get("initializer_range") or 0.02)
    f["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    f.update(family.implicit)
    if "qkv_bias" in hf:
        f["add_qkv_bias"] = bool(hf["qkv_bias"])

    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act in HF_ACTIVATIONS:
        f["activation"] = HF_ACTIVATIONS[act]
    else:
        problems.append(f"hidden_act={act!r}: only SwiGLU (silu) and GeGLU (gelu_pytorch_tanh) MLPs are supported")
    family.read_hf(hf, f, problems)
    for feat in features():
        feat.read(hf, f, problems)

    if base.get("num_moe_experts") and "num_moe_experts" not in f:  # else a feature read the MoE keys
        f["num_moe_experts"] = int(base["num_moe_experts"])
        f["moe_router_topk"] = int(base.get("moe_router_topk", 2))
        f["moe_ffn_hidden_size"] = int(base.get("moe_ffn_hidden_size") or base["ffn_hidden_size"])
        shared = base.get("moe_shared_expert_intermediate_size")
        f["moe_shared_expert_intermediate_size"] = int(shared) if shared else None
        if not shared:
            f["moe_shared_expert_gate"] = False
        # HF families either renormalise the top-k softmax probabilities (Mixtral,
        # norm_topk_prob=true) or keep the full-softmax probabilities (Qwen2-MoE default).
        f["moe_router_pre_softmax"] = not bool(hf.get("norm_topk_prob", True))
        f["moe_layer_pattern"] = _moe_pattern(hf, f["num_layers"])
        if f["moe_router_topk"] == 1 and not f["moe_router_pre_softmax"]:
            problems.append("top-1 routing with renormalised probabilities (always 1.0) is not supported")
        if float(hf.get("router_jitter_noise") or 0.0) > 0:
            problems.append("router_jitter_noise > 0 (training-time router noise) is not supported; set it to 0")
    if problems:
        raise UnsupportedFeatures(
            f"{f['architecture']} config cannot be bridged faithfully:\n" + "\n".join(f"  - {p}" for p in problems)
        )
    f["name"] = hf.get("_name_or_path") or hf.get("model_type", "")
    return BridgeSpec.make(**f)


def load_spec(path: str | Path, *, make_vocab_size_divisible_by: int = 128) -> BridgeSpec:
    return spec_from_hf(read_hf_config(path), make_vocab_size_divisible_by=make_vocab_size_divisible_by)


def spec_to_hf_config(spec: BridgeSpec) -> dict[str, Any]:
    """A config.json for `spec` (export of a model that has no HF source directory).

    `spec_from_hf(spec_to_hf_config(s)) == s` for every supported spec; the family's
    `hf_names` / `window_key` say where its config spells things differently."""
    fam = weight_family(spec.family)
    names = dict(fam.hf_names)
    cfg: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": fam.model_types[0],
        names.get("activation", "hidden_act"): next(k for k, v in HF_ACTIVATIONS.items() if v == spec.activation),
        "num_hidden_layers": spec.num_layers,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.ffn_hidden_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.norm_epsilon,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_dropout": spec.attention_dropout,
        "initializer_range": spec.initializer_range,
        "pad_token_id": None,  # no tokenizer known; some config classes default to ids past a small vocab (Phi-3)
    }
    for f, value in (("add_qkv_bias", spec.add_qkv_bias),):
        if f in names:
            cfg[names[f]] = value
    if spec.is_moe:
        cfg[names.get("num_moe_experts", "num_experts")] = spec.num_moe_experts
        cfg["num_experts_per_tok"] = spec.moe_router_topk
        cfg[names.get("moe_ffn_hidden_size", "moe_intermediate_size")] = spec.moe_ffn_hidden_size
        if spec.moe_shared_expert_intermediate_size:
            cfg[names.get("moe_shared_expert_intermediate_size", "shared_expert_intermediate_size")] = (
                spec.moe_shared_expert_intermediate_size
            )
        cfg["norm_topk_prob"] = not spec.moe_router_pre_softmax
        if spec.moe_layer_pattern:
            cfg["mlp_only_layers"] = [i for i, moe in enumerate(spec.moe_layer_pattern) if not moe]
            cfg["decoder_sparse_step"] = 1
    for feat in features():
        feat.to_hf(spec, cfg)
    fam.write_hf(spec, cfg)
    return cfg


__all__ = [
    "HF_KEYS",
    "base_fields",
    "UnsupportedFeatures",
    "read_hf_config",
    "spec_from_hf",
    "spec_to_hf_config",
    "load_spec",
]
