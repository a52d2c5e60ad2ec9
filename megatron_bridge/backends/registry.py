"""The backends, by name, and the backend of a description."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.backends.base import Backend
from megatron_bridge.backends.native import NativeBackend
from megatron_bridge.bridge.spec import BridgeSpec

# in the order `auto` tries them
BACKENDS: dict[str, Backend] = {b.name: b for b in (NativeBackend(),)}


def backend_of(spec: BridgeSpec) -> Backend:
    """The backend that describes, builds, names and counts `spec`."""
    return BACKENDS[spec.backend]


def backend_for(hf: Mapping[str, Any]) -> Backend:
    """The first backend that handles this config.json (`auto`); the native one refuses an
    architecture it does not know with its own message."""
    return next((b for b in BACKENDS.values() if b.handles(hf)), BACKENDS["native"])


__all__ = ["BACKENDS", "backend_of", "backend_for"]
