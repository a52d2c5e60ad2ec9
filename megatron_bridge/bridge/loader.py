"""Which HF tensors fill which rank's megatron shards: the torch-free half of loading.

An offline converter uses it without a model or process group, and the live loader
(runtime/weights.py: `load_hf_weights`, `export_hf_weights`) on top of it:

* `HFCheckpoint` — a lazy view of an HF directory's safetensors (the converter's reader).
* `resolve_checkpoint(spec, keys)` — every table row the checkpoint fills (unknown tensors
  are an error); `chunk_plan` — {rank-local megatron name: row} for one rank's coordinates
  (`Coords`, placed by the backend's `owned`), `shard_for` — which piece of a row that rank
  holds, `shard_of` — that piece as a tensor.
* `rank_shards(spec, layout, ckpt, coords)` — for one rank's coordinates, yield (rank-local
  megatron name, tensor) for every parameter that rank holds, reading only its slices.
* `_write_config_and_assets` — config.json and the tokenizer files of an exported model.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.features.mtp import mtp_keys, note_skipped
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.layout import Coords, Layout, ep_part
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_hf
from megatron_bridge.convert.formats import fp8
from megatron_bridge.convert.formats.paths import confined
from megatron_bridge.convert.formats.safetensors_io import LazySlice, PositionedReader, TensorInfo, scan_dir
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where tensors are made: resolving rows and shards is torch-free
    import torch

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class HFTensors(Protocol):
    """What a loader reads HF tensors through: an HF directory (`HFCheckpoint`) or a converted
    checkpoint seen as one (`convert.sources.hf_view.ConvertedTensors`); `path` for messages."""

    path: Path

    def keys(self) -> list[str]: ...

    def slice(self, name: str) -> Any: ...


class HFCheckpoint:
    """Lazy view of an HF model directory's safetensors (single file or sharded + index).

    The converter's reader (`convert.formats.safetensors_io`), so loading and `mbr convert`
    accept and refuse the same directories: headers and index validated up front (a truncated
    or corrupt file is one message naming it), tensors read with positioned reads into
    recycled buffers, no mmap (pages read do not stay in the process's RSS)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        stored = scan_dir(self.path)
        # fp8 block-quantised weights read as their bf16 dequantisation; the scales are consumed
        cfg = self.path / "config.json"
        block = fp8.block_size(read_hf_config(cfg), str(self.path)) if cfg.is_file() else None
        self.quant = fp8.pair(stored, block, str(self.path))
        scales = {q.scale.name for q in self.quant.values()}
        self.infos: dict[str, TensorInfo] = {k: v for k, v in stored.items() if k not in scales}
        self._reader = PositionedReader()

    def keys(self) -> list[str]:
        return list(self.infos)

    def slice(self, name: str) -> LazySlice | fp8.Fp8Slice:
        q = self.quant.get(name)
        return LazySlice(self.infos[name], self._reader) if q is None else fp8.Fp8Slice(q, self._reader.read_bytes)

    def tensor(self, name: str) -> torch.Tensor:
        q = self.quant.get(name)
        return self._reader.read(self.infos[name]) if q is None else fp8.read_torch(q, self._reader.read_bytes)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def table_for(spec: BridgeSpec):
    """The rows naming and sharding `spec`'s checkpoint tensors: its backend's table."""
    return backend_of(spec).table(spec)


def resolve_checkpoint(spec: BridgeSpec, keys: Sequence[str]) -> list[Resolved]:
    """Every table row the checkpoint fills; unknown HF tensors are an error, not ignored
    (multi-token-prediction layers, which the bridge does not build, are skipped with a note)."""
    skip = set(mtp_keys(spec, keys))
    if skip:
        note_skipped(spec, sorted(skip))
        keys = [k for k in keys if k not in skip]
    rows, unused = resolve_hf(table_for(spec), keys, spec.num_moe_experts)
    if unused:
        raise UserError(
            f"{len(unused)} HF tensor(s) match no row of the {spec.family} table (the checkpoint has "
            f"weights the bridge would drop): {', '.join(unused[:8])}{' ...' if len(unused) > 8 else ''}"
        )
    return rows


def chunk_plan(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved], coords: Coords) -> dict[str, Resolved]:
    """{rank-local megatron name: row} for the chunk at `coords`."""
    layers = layout.stage_layers(spec.num_layers, coords.pp_rank, coords.vp_stage)
    backend, plan = backend_of(spec), {}
    for r in rows:
        local = backend.owned(spec, r, layout, coords, layers)
        if local is not None:
            plan[local] = r
    return plan


def shard_for(row: Resolved, layout: Layout, coords: Coords) -> Shard:
    """Which piece of `row` the rank at `coords` holds: experts split over the expert-TP
    group, everything else over TP (for `Transform.blocks`, or `shard_of` with tensors)."""
    return Shard(coords.etp_rank, layout.etp) if row.mapping.is_expert else Shard(coords.tp_rank, layout.tp)


def shard_of(row: Resolved, tensors: Sequence[Any], spec: BridgeSpec, layout: Layout, coords: Coords) -> torch.Tensor:
    """The tensor the rank at `coords` holds of `row`: its TP piece, and of a tensor stacking
    every expert (`Backend.ep_stacked`) that rank's run of experts."""
    t = row.mapping.shard(row.select(tensors), shard_for(row, layout, coords), spec.shapes(layout.tp))
    return ep_part(t, layout.ep, coords.ep_rank) if layout.ep > 1 and backend_of(spec).ep_stacked(spec, row) else t


def rank_shards(
    spec: BridgeSpec, layout: Layout, ckpt: HFCheckpoint, coords: Coords
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pure: (local name, tensor) of every parameter of the chunk at `coords`, one at a time."""
    for local, row in chunk_plan(spec, layout, resolve_checkpoint(spec, ckpt.keys()), coords).items():
        yield local, shard_of(row, [ckpt.slice(n) for n in row.hf], spec, layout, coords)


def _write_config_and_assets(out: Path, spec: BridgeSpec, source_dir, hf_config, dtype) -> None:
    if hf_config is None and source_dir is not None:
        hf_config = read_hf_config(source_dir)
    if hf_config is None:
        hf_config = backend_of(spec).hf_config(spec)
    cfg = dict(hf_config)
    cfg.pop("quantization_config", None)  # exported weights are never quantised (an fp8 source reads as bf16)
    if dtype is not None:
        cfg["dtype"] = str(dtype).replace("torch.", "")
        cfg.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        for name in hf_assets(Path(source_dir)):
            shutil.copy2(Path(source_dir) / name, out / name)


def hf_assets(source_dir: Path, skip: Collection[str] = ("config.json",)) -> list[str]:
    """The files an HF directory ships besides its weights and `skip` (tokenizer, generation
    config), copied along by convert and export. A symbolic link leading out of the directory
    is refused (`paths.confined`): its target would be copied into the output."""
    names = [
        f.name
        for f in sorted(source_dir.iterdir())
        if f.is_file() and f.name not in skip and not f.name.endswith(WEIGHT_FILE_SUFFIXES)
    ]
    for n in names:
        confined(source_dir, n, source=source_dir, what="file", verb="holds", plain=True)
    return names


__all__ = [
    "HFCheckpoint",
    "HFTensors",
    "hf_assets",
    "WEIGHT_FILE_SUFFIXES",
    "shard_for",
    "shard_of",
    "rank_shards",
    "chunk_plan",
    "resolve_checkpoint",
    "table_for",
]
