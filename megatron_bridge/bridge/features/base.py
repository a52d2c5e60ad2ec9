"""The description hooks of the building blocks: how each one's settings travel between
config.json and the spec.

A family never says *how* a building block is made; its config (or its `implicit` fields)
turns spec fields on, and every registered feature looks at the config and the spec and does
its part. A feature is one class in one file under `features/`, listed in `FEATURE_MODULES`:

    read(hf, fields, problems)      config.json -> BridgeSpec fields (append refusals to problems)
    to_hf(spec, cfg)                BridgeSpec -> config.json (export of a model without source)

Torch-free, like the rest of the core. How a block is *built* (TransformerConfig kwargs, the
per-layer module specs, hooks on the built model, its megatron modules) is the runtime's:
`runtime/blocks/`, one file per block that has build hooks. Shared code calls the hooks of
every feature in order and never branches on a family.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from megatron_bridge.ordered_registry import OrderedRegistry

# modules under bridge/features that register features, in the order their hooks run
FEATURE_MODULES = (
    "attention",
    "rope",
    "mla",
    "moe_routing",
    "mtp",
    "scaling",
    "qk_norm",
    "bias",
    "glu",
)


class Feature:
    """Base of a building block's description; every hook is optional (the default does nothing)."""

    name: ClassVar[str] = ""

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        """Set the spec fields this feature owns from an HF config dict."""

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        """Write this feature's settings into a config.json dict."""


_REGISTRY: OrderedRegistry[type[Feature]] = OrderedRegistry(
    "megatron_bridge.bridge.features", FEATURE_MODULES, "feature"
)
register_feature = _REGISTRY.register
features = _REGISTRY.all  # every feature, in `FEATURE_MODULES` order


__all__ = ["Feature", "register_feature", "features", "FEATURE_MODULES"]
