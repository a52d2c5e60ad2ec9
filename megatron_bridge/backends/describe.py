"""`describe(cfg.model)`: the recipe's model group -> the one model description.

Called once, right after a recipe is composed; every consumer takes its result. This is the
only function that reads the model group (`config.ModelConfig`, the recipe's input schema):
with `model.hf_path` the description is that directory's config.json (parsed by
`bridge.hf_config.read_hf_config`, the one config.json parser; the group's other fields do not
apply, except `make_vocab_size_divisible_by`, which config.json has no key for); without it,
the group's fields describe a model of `model.family`. A command whose input *is* an HF
directory (`mbr convert src=`, `mbr verify`) passes it as `hf_path=` (and, when it has already
read config.json for its own checks, the parsed dict as `hf=`).

A config the backend cannot reproduce, or a family no backend knows, is refused here as the
violation of a named rule (`hf-model`, `model-family`, `hidden-heads`), like every other rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_bridge.backends.registry import BACKENDS, backend_for
from megatron_bridge.bridge.hf_config import UnsupportedFeatures, read_hf_config
from megatron_bridge.bridge.registry import families
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import LayoutError
from megatron_bridge.parallel.rules.base import Violation


def describe(
    model: Any,
    *,
    hf_path: str | Path | None = None,
    hf: Mapping[str, Any] | None = None,
    arg: str = "model.hf_path",
) -> BridgeSpec:
    """The description of `model` (a composed `ModelConfig`), or of the HF model `hf_path`
    (`arg` is how the command line names it) when the command's input is one."""
    path = hf_path if hf_path is not None else model.hf_path
    if path is not None or hf is not None:
        config = hf if hf is not None else read_hf_config(path, arg=arg)
        try:
            spec = describe_hf(config, make_vocab_size_divisible_by=model.make_vocab_size_divisible_by)
        except UnsupportedFeatures as e:
            raise _refused(
                "hf-model",
                f"{arg}={path}: {e}",
                "use a model whose features the bridge reproduces (`mbr verify --list`)",
            ) from None
        return dataclasses.replace(spec, source=None if path is None else str(path))
    known = {f.name for f in families()}
    if model.family not in known:
        raise _refused(
            "model-family",
            f"model.family={model.family!r} is not a family the builder knows",
            f"use one of {', '.join(sorted(known))}",
        )
    if model.kv_channels is None and model.hidden_size % model.num_attention_heads:
        raise _refused(
            "hidden-heads",
            f"hidden_size={model.hidden_size} is not divisible by num_attention_heads={model.num_attention_heads}",
            "set model.kv_channels (head dim) explicitly",
        )
    spec = BACKENDS["native"].describe_fields(dataclasses.asdict(model))
    return dataclasses.replace(spec, name=model.name, described_from="model fields")


def describe_hf(hf: Mapping[str, Any], *, make_vocab_size_divisible_by: int = 128) -> BridgeSpec:
    """The description of a parsed config.json, by the backend that handles it (a converted
    checkpoint's manifest records one; export and reshard describe it with this)."""
    return backend_for(hf).describe(hf, make_vocab_size_divisible_by=make_vocab_size_divisible_by)


def _refused(rule: str, detail: str, fix: str) -> LayoutError:
    return LayoutError([Violation(rule, detail, fix)], header="The model breaks 1 rule:")


__all__ = ["describe", "describe_hf"]
