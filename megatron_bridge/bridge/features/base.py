"""The feature hooks: how one building block reaches config.json, the spec, megatron's
TransformerConfig, the per-layer module specs and the built model.

A family never says *how* a building block is made; its config (or its `implicit` fields)
turns spec fields on, and every registered feature looks at the spec and does its part. A
feature is one class in one file under `features/`, listed in `FEATURE_MODULES`:

    read(hf, fields, problems)      config.json -> BridgeSpec fields (append refusals to problems)
    to_hf(spec, cfg)                BridgeSpec -> config.json (export of a model without source)
    config(spec, kw)                TransformerConfig kwargs
    layer(spec, index, layer_spec)  edit one layer's ModuleSpec (a private copy; global 0-based index)
    block(spec, block_spec)         edit the block's TransformerBlockSubmodules (final norm)
    model(spec, chunk)              after GPTModel is built (hooks on embedding / output layer)

Shared code calls the hooks of every feature in order and never branches on a family.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, ClassVar

# modules under bridge/features that register features, in the order their hooks run
FEATURE_MODULES = (
    "attention",
    "rope",
    "mla",
    "moe_routing",
    "mtp",
    "norms",
    "sublayer",
    "scaling",
    "qk_norm",
    "sinks",
    "bias",
    "glu",
    "expert_grads",
)

_FEATURES: list[type[Feature]] = []
_LOADED = False


class Feature:
    """Base of a building block; every hook is optional (the default does nothing)."""

    name: ClassVar[str] = ""

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        """Set the spec fields this feature owns from an HF config dict."""

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        """Write this feature's settings into a config.json dict."""

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        """Adjust the TransformerConfig keyword arguments."""

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        """Edit the ModuleSpec of global layer `index` (0-based; a private deep copy)."""

    @classmethod
    def block(cls, spec: Any, block_spec: Any) -> None:
        """Edit the TransformerBlockSubmodules (its `layer_norm` is the final norm)."""

    @classmethod
    def model(cls, spec: Any, chunk: Any) -> None:
        """Adjust one built GPTModel chunk (pre_process/post_process tell which ends it has)."""


def register_feature(cls: type[Feature]) -> type[Feature]:
    if not cls.name:
        raise TypeError(f"{cls.__name__}: a feature needs a name")
    if cls not in _FEATURES:
        _FEATURES.append(cls)
    return cls


def features() -> list[type[Feature]]:
    """Every feature, in `FEATURE_MODULES` order."""
    global _LOADED
    if not _LOADED:  # not `if not _FEATURES`: importing one feature module directly registers it alone
        for mod in FEATURE_MODULES:
            importlib.import_module(f"megatron_bridge.bridge.features.{mod}")
        order = {m: i for i, m in enumerate(FEATURE_MODULES)}
        _FEATURES.sort(key=lambda c: order[c.__module__.rsplit(".", 1)[-1]])
        _LOADED = True
    return list(_FEATURES)


__all__ = ["Feature", "register_feature", "features", "FEATURE_MODULES"]
