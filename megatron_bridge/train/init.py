"""`train.init_from=DIR`: start training from existing weights.

An HF directory (config.json + safetensors) goes through the bridge's mapping tables, each
rank reading only its shard. `mbr convert` outputs are read by the converter's loader
(megatron_bridge.convert), which shares the same tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.errors import UserError


def load_initial_weights(chunks: Sequence[Any], spec: Any, path: str) -> None:
    p = Path(path)
    if (p / "config.json").is_file() and (any(p.glob("*.safetensors"))):
        from megatron_bridge.bridge.loader import load_hf_weights

        load_hf_weights(chunks, spec, p)
        return
    if (p / "mbr_manifest.json").is_file():
        from megatron_bridge.convert.load import load_converted

        load_converted(chunks, spec, p)
        return
    raise UserError(
        f"train.init_from={path} is neither a Hugging Face model directory (config.json + "
        "*.safetensors) nor a `mbr convert` output (mbr_manifest.json)."
    )
