"""Multi-token prediction layers (DeepSeek-V3 `num_nextn_predict_layers`, transformers'
`num_mtp_layers`): the checkpoint stores them as model.layers.{num_hidden_layers + i}.

The bridge builds no MTP block (transformers does not run them either), so `mtp_num_layers`
only records that they exist: `loader.resolve_checkpoint` skips those tensors with a printed
note (online load and `mbr convert` alike), and export says it did not write them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def mtp_keys(spec: Any, keys: Sequence[str]) -> list[str]:
    """The checkpoint tensors of MTP layers (layer index >= num_layers)."""
    if not spec.mtp_num_layers:
        return []
    out = []
    for k in keys:
        m = _LAYER.match(k)
        if m and int(m.group(1)) >= spec.num_layers:
            out.append(k)
    return out


def note_skipped(spec: Any, skipped: Sequence[str] | None) -> None:
    """Print what happened to the MTP layers: `skipped` tensors on load, None on export."""
    if not spec.mtp_num_layers:
        return
    where = f"{spec.mtp_num_layers} multi-token-prediction layer(s) (model.layers.{spec.num_layers}+)"
    what = f"skipping {len(skipped)} tensor(s) of {where}" if skipped is not None else f"export did not write {where}"
    print(f"note: {what}: the bridge does not build MTP layers", flush=True)


@register_feature
class MultiTokenPrediction(Feature):
    name = "mtp"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        fields["mtp_num_layers"] = int(hf.get("num_nextn_predict_layers") or hf.get("num_mtp_layers") or 0)

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        if spec.mtp_num_layers:
            cfg["num_nextn_predict_layers"] = spec.mtp_num_layers


__all__ = ["MultiTokenPrediction", "mtp_keys", "note_skipped"]
