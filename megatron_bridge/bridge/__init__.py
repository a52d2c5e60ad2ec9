"""Hugging Face models ⇄ megatron-core parallel models: the description (see docs/bridge.md).

    spec = load_spec(hf_dir)                      # HF config.json -> BridgeSpec (refuses what it can't do)

The weight tables (`families/`, rows of `table.Mapping`) are pure tensor functions (the
transforms in `mapping.py`), shared by online loading, export and offline conversion
(`loader.rank_shards`). Importing this package imports neither megatron-core nor torch
(`mbr convert` never needs them). Building, loading and exporting a live model is the
runtime's:

    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import export_hf_weights, load_hf_weights

    chunks = build_model(spec, Layout(tp=2, pp=2), load_weights=True)   # this rank's chunk(s), no random init
    load_hf_weights(chunks, spec, hf_dir)         # each rank reads only its slices
    export_hf_weights(chunks, spec, out_dir, source_dir=hf_dir)   # back to HF names/shapes
"""

from megatron_bridge.bridge.hf_config import load_spec, read_hf_config, spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.layout import Layout, dist_ckpt_key, local_experts, to_local_name
from megatron_bridge.bridge.loader import Coords, HFCheckpoint, rank_shards, resolve_checkpoint
from megatron_bridge.bridge.mapping import Shapes, Shard
from megatron_bridge.bridge.registry import FamilyBridge, describe, families, family_for, get_family, register
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping

__all__ = [
    "BridgeSpec",
    "load_spec",
    "spec_from_hf",
    "spec_to_hf_config",
    "read_hf_config",
    "Layout",
    "local_experts",
    "to_local_name",
    "Coords",
    "HFCheckpoint",
    "rank_shards",
    "resolve_checkpoint",
    "Mapping",
    "Shapes",
    "Shard",
    "dist_ckpt_key",
    "FamilyBridge",
    "register",
    "families",
    "family_for",
    "get_family",
    "describe",
]
