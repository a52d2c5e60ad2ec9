"""The model and layout a converted checkpoint's manifest records, as the bridge's objects.

`formats.manifest` stores them as plain JSON (the source's HF config, the layout's degrees,
the vocabulary divisor); here they are read back as the `BridgeSpec` the checkpoint holds
and the `Layout` it was written for, and a `Layout` is turned into its record.
"""

from __future__ import annotations

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.registry import BACKENDS
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.convert.formats.manifest import LayoutRecord, Manifest
from megatron_bridge.errors import UserError


def layout_record(layout: Layout) -> LayoutRecord:
    return {
        "tp": layout.tp,
        "pp": layout.pp,
        "vpp": layout.vpp,
        "ep": layout.ep,
        "etp": layout.etp,
        "layers_first_stage": layout.layers_first_stage,
        "layers_last_stage": layout.layers_last_stage,
    }


def manifest_layout(man: Manifest) -> Layout:
    d = man.layout
    return Layout(
        tp=d["tp"],
        pp=d["pp"],
        vpp=d.get("vpp"),
        ep=d.get("ep", 1),
        etp=d.get("etp") or d["tp"],  # older manifests: expert TP = tp
        layers_first_stage=d.get("layers_first_stage"),
        layers_last_stage=d.get("layers_last_stage"),
    )


def manifest_spec(man: Manifest) -> BridgeSpec:
    """The model the checkpoint holds, described by the backend that wrote it."""
    if man.backend not in ("auto", *BACKENDS):
        raise UserError(
            f"the manifest names backend {man.backend!r}, which this mbr does not have "
            f"(it has {', '.join(BACKENDS)}): the checkpoint was written by another version"
        )
    return describe_hf(
        man.hf_config, make_vocab_size_divisible_by=man.make_vocab_size_divisible_by, backend=man.backend
    )


def stored_vocab_rows(man: Manifest) -> int:
    """Rows of the stored embedding: the vocabulary padded for the layout it was written at."""
    return manifest_spec(man).padded_vocab_size(man.layout["tp"])


__all__ = ["layout_record", "manifest_layout", "manifest_spec", "stored_vocab_rows"]
