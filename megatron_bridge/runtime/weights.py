"""HF weights into and out of a live model: this rank's chunks, by the model's backend.

Loading and gathering are the backend's (`runtime_of(spec).load` / `.iter_tensors`:
runtime/native/weights.py, runtime/transformers/weights.py); writing the directory is shared:

* `load_hf_weights(chunks, spec, path)` — this rank's slices of an HF directory's tensors
  into its chunks, names checked both ways, nothing read that the rank does not hold.
* `export_hf_weights(chunks, spec, out_dir, source_dir=...)` — gathers each tensor's shards
  onto one replica, merged back to HF names and shapes with the backend's table, and every
  writing rank streams its tensors into its own safetensors file as they are gathered
  (runtime/safetensors_stream.py: host memory holds one tensor, not a stage; the bytes equal
  `save_file`'s); rank 0 writes the index, config.json and copies the tokenizer files
  (runtime/hf_export.py: in the step, or behind the training loop).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.bridge.features.mtp import note_skipped
from megatron_bridge.bridge.hf_config import BridgeSpec
from megatron_bridge.bridge.loader import HFCheckpoint, _write_config_and_assets
from megatron_bridge.convert.formats.manifest import INDEX_CRC32
from megatron_bridge.runtime.hf_export import HFExport
from megatron_bridge.runtime.runtimes import runtime_of
from megatron_bridge.runtime.weights_base import (
    Into,
    cast_free,
    checkpoint_tensors,
    current_coords,
    gather_shards,
    layout_of,
    require_all_written,
    vp_stage_of,
)


def load_hf_weights(chunks: Sequence[Any], spec: BridgeSpec, path: str | Path | HFCheckpoint) -> int:
    """Copy HF weights into this rank's model chunks, by the loader of the model's backend
    (`runtime_of(spec).load`). Returns the number of tensors loaded."""
    with torch.no_grad():
        if isinstance(path, HFCheckpoint):
            return runtime_of(spec).load(chunks, spec, path)
        with HFCheckpoint(path) as ckpt:
            return runtime_of(spec).load(chunks, spec, ckpt)


def iter_hf_tensors(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    dtype: torch.dtype | None = None,
    value: Any | None = None,
    *,
    everywhere: bool = False,
    into: Into | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over all ranks: gather every exported parameter's shards to one replica and
    yield (HF name, full HF tensor) there, by the exporter of the model's backend
    (`runtime_of(spec).iter_tensors`). Every rank must iterate it to the end. Each tensor is new memory (gathered
    or cloned, never a view of a parameter), so a caller may keep it while training goes on
    (runtime/hf_export.py does). `value(param)` picks what is
    exported (default the weight; e.g. `lambda p: p.main_grad`). `everywhere`: every rank of
    a pipeline stage gathers and yields its stage's tensors, all in the same order (all-gathers
    instead of gathers; experts from every EP rank): what stream.py's broadcast mode sends on.
    `into` (weights_base.Into): where the caller wants named tensors to land (stream.py's
    layout="model": an expert's slot in its stacked tensor); the tensor yielded is then that
    destination, not new memory. Honoured only where no `dtype` cast intervenes."""
    return runtime_of(spec).iter_tensors(chunks, spec, dtype, value, everywhere, into=cast_free(into, dtype))


def export_hf_weights(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    hf_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the model as an HF directory loadable by `AutoModelForCausalLM.from_pretrained`.

    Collective (every rank calls it). Weights: one safetensors file per writing rank plus
    `model.safetensors.index.json`. config.json: `hf_config` if given, else the source's, else
    generated from the spec (`spec_to_hf_config`). Every non-weight file of `source_dir`
    (tokenizer, generation config) is copied."""
    return start_hf_export(chunks, spec, out_dir, source_dir=source_dir, hf_config=hf_config, dtype=dtype).finish()


def start_hf_export(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    out_dir: str | Path,
    *,
    source_dir: str | Path | None = None,
    hf_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    buffer_bytes: int = 0,
    publish_as: Path | None = None,
) -> HFExport:
    """`export_hf_weights` whose writing may go on behind the caller (`buffer_bytes` > 0,
    runtime/hf_export.py): collective; the caller ends it with `finish()` on every rank."""

    def write_index(out: Path, rows: list[tuple[str, str, int]], crcs: dict[str, str]) -> None:  # rank 0, at the end
        weight_map = {k: fname for k, fname, _ in rows}
        meta = {"total_size": sum(n for *_, n in rows), INDEX_CRC32: crcs}
        index = {"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _write_config_and_assets(out, spec, source_dir, hf_config, dtype)
        if spec.mtp_num_layers:
            note_skipped(spec, None)

    tensors = iter_hf_tensors(chunks, spec, dtype)
    return HFExport(Path(out_dir), tensors, write_index, buffer_bytes=buffer_bytes, publish_as=publish_as)


__all__ = [
    "checkpoint_tensors",
    "current_coords",
    "export_hf_weights",
    "gather_shards",
    "iter_hf_tensors",
    "layout_of",
    "load_hf_weights",
    "require_all_written",
    "start_hf_export",
    "vp_stage_of",
]
