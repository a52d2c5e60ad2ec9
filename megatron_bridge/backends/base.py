"""`Backend`: the interface every model backend implements (the torch-free half).

The fourth operation, building a rank's model chunks, needs torch and megatron-core, so it
lives in the runtime layer (`runtime/build.py`, keyed by `Backend.name`); everything here is
plain data and arithmetic that `mbr check`, `mbr plan` and `mbr convert` use without torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from megatron_bridge.bridge.registry import FamilyBridge
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping as Row
from megatron_bridge.plan.params import ParamCount


class Backend(ABC):
    """One way of turning an HF model into megatron-parallel modules."""

    name: ClassVar[str]

    @abstractmethod
    def handles(self, hf: Mapping[str, Any]) -> bool:
        """Whether this backend can describe the HF config (`auto` picks the first that can)."""

    @abstractmethod
    def describe(self, hf: Mapping[str, Any], *, make_vocab_size_divisible_by: int) -> BridgeSpec:
        """config.json (parsed) -> the description; refuses what it cannot reproduce
        (`bridge.hf_config.UnsupportedFeatures`, one line per feature)."""

    @abstractmethod
    def describe_fields(self, fields: Mapping[str, Any]) -> BridgeSpec:
        """A model given by the recipe's model-group fields alone (no config.json)."""

    @abstractmethod
    def table(self, spec: BridgeSpec) -> tuple[Row, ...]:
        """The checkpoint tensors: HF names <-> megatron names and how each is sharded."""

    @abstractmethod
    def count(self, spec: BridgeSpec) -> ParamCount:
        """Exact parameter counts (total, active, embedding, per layer kind)."""

    @abstractmethod
    def hf_config(self, spec: BridgeSpec) -> dict[str, Any]:
        """The config.json of `spec` (export of a model that has no HF source directory)."""

    def family_of(self, spec: BridgeSpec) -> type[FamilyBridge] | None:
        """The native family declarations the model rules check (its fixed architecture, HF
        weights, LoRA targets); None for a model described without one."""
        return None

    def layout_limits(self, spec: BridgeSpec, layout: Any) -> list[tuple[str, str]]:
        """(what this backend cannot build under `layout`, the fix), one per limit: the
        `backend-layout` rule refuses them before any process group."""
        return []

    def run_limits(self, spec: BridgeSpec, run: Any) -> list[tuple[str, str]]:
        """(what this backend cannot do in the training run `run` (the whole config), the fix): the `backend-run` rule
        refuses them (`mbr check`, `mbr plan`, training) before any process group."""
        return []

    def convert_limits(self, spec: BridgeSpec) -> list[tuple[str, str]]:
        """(why `mbr convert` cannot write this model's megatron checkpoint, the fix)."""
        return []


__all__ = ["Backend"]
