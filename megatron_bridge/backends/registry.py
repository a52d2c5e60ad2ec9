"""The backends, by name, and the backend of a description."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.backends.base import Backend
from megatron_bridge.backends.native.backend import NativeBackend
from megatron_bridge.backends.transformers.backend import TransformersBackend
from megatron_bridge.bridge.spec import BridgeSpec

# in the order `auto` tries them
BACKENDS: dict[str, Backend] = {b.name: b for b in (NativeBackend(), TransformersBackend())}
ALIASES = {"hf": "transformers"}  # `model.backend=` spellings that name a backend above


def backend_named(choice: str) -> str:
    """The backend `model.backend=choice` (or a manifest) names: one of BACKENDS, "auto", or
    `choice` unchanged when it names none (the caller refuses it)."""
    return ALIASES.get(choice, choice)


def backend_of(spec: BridgeSpec) -> Backend:
    """The backend that describes, builds, names and counts `spec`."""
    return BACKENDS[spec.backend]


def backend_for(hf: Mapping[str, Any]) -> Backend | None:
    """The first backend that handles this config.json (what `auto` picks), None if none does."""
    return next((b for b in BACKENDS.values() if b.handles(hf)), None)


__all__ = ["ALIASES", "BACKENDS", "backend_for", "backend_named", "backend_of"]
