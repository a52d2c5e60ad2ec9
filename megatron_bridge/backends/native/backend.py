"""`native`: megatron-core's GPTModel built from a family's declarations (bridge/families/)
and the building blocks (bridge/features/, runtime/blocks/) — the curated, fast path.

Describing is `bridge.hf_config.spec_from_hf`, the weight table is the family's, counting is
the planner's per-layer arithmetic over the spec (plan/params.py), building is
`runtime/build.py`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_bridge.backends.base import Backend, Shape
from megatron_bridge.backends.native import checkpoint
from megatron_bridge.bridge.hf_config import spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.lora import layer_adapter_params
from megatron_bridge.bridge.registry import FamilyBridge, families, get_family, weight_family
from megatron_bridge.bridge.spec import BridgeSpec, field_names
from megatron_bridge.bridge.table import Mapping as Row
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.plan.params import ParamCount, count, native_shards
from megatron_bridge.plan.shards import ModelShards

# model-group fields that are not architecture, or reach the spec resolved under another name
NOT_SPEC_FIELDS = ("name", "hf_path", "backend", "kv_channels", "num_query_groups", "moe_ffn_hidden_size", "freeze")


class NativeBackend(Backend):
    name = "native"

    def handles(self, hf: Mapping[str, Any]) -> bool:
        archs = set(hf.get("architectures") or ())
        return any(archs & set(f.architectures) or hf.get("model_type") in f.model_types for f in families())

    def describe(self, hf: Mapping[str, Any], *, make_vocab_size_divisible_by: int) -> BridgeSpec:
        return spec_from_hf(hf, make_vocab_size_divisible_by=make_vocab_size_divisible_by)

    def describe_fields(self, fields: Mapping[str, Any]) -> BridgeSpec:
        """Every model-group field that names architecture is a spec field of the same name and
        is copied by name (a test holds the two field lists together), so nothing the planner
        counts or the rules check can be dropped on the way to the builder."""
        fam = get_family(fields["family"])
        heads = fields["num_attention_heads"]
        spec_fields = field_names()
        f = {k: v for k, v in fields.items() if k in spec_fields and k not in NOT_SPEC_FIELDS}
        f.update(
            family=fam.name,
            architecture=fam.architectures[0] if fam.architectures else "",
            num_query_groups=fields["num_query_groups"] or heads,
            head_dim=fields["kv_channels"] or fields["hidden_size"] // heads,
        )
        f.update(fam.implicit)
        if fields["num_moe_experts"]:
            f["moe_ffn_hidden_size"] = fields["moe_ffn_hidden_size"] or fields["ffn_hidden_size"]
            if not fields["moe_shared_expert_intermediate_size"]:
                f["moe_shared_expert_gate"] = False
        else:
            f.update(num_moe_experts=None, moe_shared_expert_intermediate_size=None)
        return BridgeSpec.make(**f)

    def table(self, spec: BridgeSpec) -> tuple[Row, ...]:
        return weight_family(spec.family).mappings(spec)

    def count(self, spec: BridgeSpec) -> ParamCount:
        return count(spec)

    def shards(self, spec: BridgeSpec) -> ModelShards:
        return native_shards(spec)

    def adapter_params(
        self, spec: BridgeSpec, peft: Any, *, tp: int, etp: int, ep: int, layers: Sequence[int], first: bool
    ) -> tuple[float, float]:
        """Every layer's adapters alike (bridge.lora.layer_adapter_params: a MoE model's
        dense-first layers counted as MoE layers)."""
        dense, per_expert = layer_adapter_params(spec, peft, tp=tp, etp=etp)
        experts = (spec.num_moe_experts or 0) / ep
        return dense * len(layers), per_expert * experts * len(layers)

    def hf_config(self, spec: BridgeSpec) -> dict[str, Any]:
        return spec_to_hf_config(spec)

    def family_of(self, spec: BridgeSpec) -> type[FamilyBridge]:
        return get_family(spec.family)

    # -- checkpoints: megatron-core's names (native/checkpoint.py) ----------------------------------
    def expected(self, spec: BridgeSpec, padded_vocab: int) -> dict[str, Shape | None]:
        names = checkpoint.expected_names(spec, self.table(spec))
        return {n: checkpoint.megatron_shape(n, spec, padded_vocab) for n in names}

    def owned(self, spec: BridgeSpec, row: Resolved, layout: Layout, coords: Coords, layers: range) -> str | None:
        return checkpoint.owned(row, spec, layout, coords, layers)

    def dist_location(self, spec: BridgeSpec, name: str) -> DistLocation:
        return checkpoint.location(name, spec)

    def dist_extra_state(self, spec: BridgeSpec, name: str) -> DistLocation | None:
        return checkpoint.extra_state_location(name, spec)

    def rank_state(self, spec: BridgeSpec, entries: dict[str, tuple[int, object]], post_process: bool) -> dict:
        return checkpoint.chunk_state_dict(entries, post_process)

    def checkpoint_args(self, spec: BridgeSpec, layout: Layout, dtype: DType, ckpt_format: str) -> argparse.Namespace:
        return checkpoint.megatron_args(spec, layout, dtype, ckpt_format)


__all__ = ["NativeBackend", "NOT_SPEC_FIELDS"]
