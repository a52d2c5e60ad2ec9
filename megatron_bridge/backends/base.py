"""`Backend`: the interface every model backend implements (the torch-free half).

Building a rank's model chunks needs torch and megatron-core, so it lives in the runtime
layer (`runtime/build.py`, keyed by `Backend.name`); everything here is plain data and
arithmetic that `mbr check`, `mbr plan` and `mbr convert` use (the transformers backend reads its
transformers model on the meta device for it). The checkpoint methods are the converter's
whole view of a backend: which tensors a model has and their shapes, where each is stored in
torch_dist and in Megatron's per-rank files, and what else a rank file holds.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.lora import Target, resolve_targets
from megatron_bridge.bridge.registry import FamilyBridge
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping as Row
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.plan.params import ParamCount
from megatron_bridge.plan.shards import ModelShards

Shape = tuple[int, ...]


class Backend(ABC):
    """One way of turning an HF model into megatron-parallel modules."""

    name: ClassVar[str]
    from_fields: ClassVar[bool] = True  # describes a model from the recipe's model-group fields alone

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
    def shards(self, spec: BridgeSpec) -> ModelShards:
        """The parameters by stage piece and how TP/EP split them (plain numbers, plan/shards.py):
        what `mbr plan` reads every per-rank count from."""

    @abstractmethod
    def adapter_params(
        self, spec: BridgeSpec, peft: Any, *, tp: int, etp: int, ep: int, layers: Sequence[int], first: bool
    ) -> tuple[float, float]:
        """LoRA parameters (dense, expert) one rank of a pipeline stage holding global `layers`
        (`first`: the first stage's pieces too) keeps for `peft`'s targets, split as the adapters
        are (column-parallel: A whole, B's rows ÷ tp; row-parallel: A's columns ÷ tp, B whole)."""

    @abstractmethod
    def hf_config(self, spec: BridgeSpec) -> dict[str, Any]:
        """The config.json of `spec` (export of a model that has no HF source directory)."""

    def family_of(self, spec: BridgeSpec) -> type[FamilyBridge] | None:
        """The native family declarations the model rules check (its fixed architecture, HF
        weights, LoRA targets); None for a model described without one."""
        return None

    def adapter_names(self, spec: BridgeSpec, row: Resolved | Row) -> list[str]:
        """The HF tensor names a LoRA adapter on `row`'s linear is keyed by in a PEFT adapter
        file (`<module>.lora_A.weight`): the modules of the model PEFT loads it onto. Native
        families: the checkpoint names, which are the modules'."""
        return list(row.hf)

    def lora_targets(
        self, spec: BridgeSpec, targets: Sequence[str], table: Sequence[Row] | None = None
    ) -> list[Target]:
        """The rows (of `table`, default this model's) whose linears `targets` adapt, matched
        against the module names PEFT adapts (`adapter_names`); a target hitting nothing is a
        UserError naming the targetable modules."""
        rows = self.table(spec) if table is None else table
        return resolve_targets(rows, list(targets), spec.family, lambda row: self.adapter_names(spec, row))

    def lora_refusals(self, spec: BridgeSpec, targets: Sequence[str]) -> list[str]:
        """`module (class)` of each module `targets` name that PEFT would adapt and this backend
        does not (none for native families: their tables name every HF linear)."""
        return []

    def freeze_groups(self, spec: BridgeSpec) -> tuple[str, ...]:
        """The parts `model.freeze` may name for this model (none: a text model has one part)."""
        return ()

    def group_of(self, spec: BridgeSpec, name: str) -> str:
        """The `freeze_groups` part tensor `name` (a checkpoint-table name) belongs to."""
        return "language"

    def adds_aux_loss(self, spec: BridgeSpec) -> bool:
        """Whether training adds transformers' router load-balancing loss where the config
        switches it on (what `mbr verify`'s reference then adds too)."""
        return False

    def layout_limits(self, spec: BridgeSpec, layout: Any) -> list[tuple[str, str]]:
        """(what this backend cannot build under `layout`, the fix), one per limit: the
        `backend-layout` rule refuses them before any process group."""
        return []

    def run_limits(self, spec: BridgeSpec, run: Any) -> list[tuple[str, str]]:
        """(what this backend cannot do in the training run `run` (the whole config), the fix): the `backend-run` rule
        refuses them (`mbr check`, `mbr plan`, training) before any process group."""
        return []

    # -- checkpoints (convert/: `mbr convert`, export, reshard; `train.init_from`) ---------------
    @abstractmethod
    def expected(self, spec: BridgeSpec, padded_vocab: int) -> dict[str, Shape | None]:
        """Every global tensor (the table's megatron side, concrete names) the config implies, in
        table order per layer, with the shape the model gives it at tp=1 over a vocabulary
        padded to `padded_vocab` rows (None: not known here, the transforms' checks only)."""

    @abstractmethod
    def owned(self, spec: BridgeSpec, row: Resolved, layout: Layout, coords: Coords, layers: range) -> str | None:
        """The name `row`'s tensor has on the chunk at `coords` (holding global `layers`), or None
        where that chunk does not hold it."""

    def ep_stacked(self, spec: BridgeSpec, row: Resolved) -> bool:
        """Whether `row`'s tensor stacks every expert on dim 0 and an expert-parallel rank keeps
        its run of them (after the TP split): the transformers backend's experts. Native expert rows are
        one expert each (`{expert}` in the name) and placed by `owned`."""
        return False

    def integer_tensors(self, spec: BridgeSpec) -> frozenset[str]:
        """HF tensors the model itself holds in an integer dtype (buffers such as a hash
        router's token table): read and written as they are, never taken for quantised weights."""
        return frozenset()

    @abstractmethod
    def dist_location(self, spec: BridgeSpec, name: str) -> DistLocation:
        """Where global tensor `name` is stored in a torch_dist checkpoint."""

    def dist_extra_state(self, spec: BridgeSpec, name: str) -> DistLocation | None:
        """The object stored beside tensor `name` in torch_dist (megatron's linears' `_extra_state`)."""
        return None

    @abstractmethod
    def rank_state(self, spec: BridgeSpec, entries: dict[str, tuple[int, object]], post_process: bool) -> dict:
        """A per-rank file's state dict of one chunk, from {local name: (table position, value)},
        with whatever else the built chunk's `state_dict()` holds."""

    @abstractmethod
    def checkpoint_args(self, spec: BridgeSpec, layout: Layout, dtype: DType, ckpt_format: str) -> argparse.Namespace:
        """The `args` stored with a checkpoint (Megatron-LM reads the parallel sizes from it)."""


__all__ = ["Backend"]
