"""HF weights into and out of an hf-backend model's chunks (`runtime/weights.py` dispatches here).

A chunk's tensors have the checkpoint's own names (global layer indices), so each is one row
of the backend's table (`HFBackend.table`: the transform says how the tensor splits over TP).
Loading reads only this rank's slices of the safetensors (`HFCheckpoint.slice`, the
converter's reader); export gathers each tensor's TP shards onto the first replica and merges
them back with the same transform, bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.bridge.loader import HFCheckpoint, resolve_checkpoint, table_for
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import resolve_megatron
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.weights_base import checkpoint_tensors, gather_shards, layout_of, require_all_written


def load(chunks: Sequence[Any], spec: BridgeSpec, ckpt: HFCheckpoint) -> int:
    """Copy this rank's slices of every checkpoint tensor into `chunks`; returns how many.
    Every HF tensor must have a row (`resolve_checkpoint`), every chunk tensor a source."""
    layout = layout_of(chunks)
    rows = {r.megatron: r for r in resolve_checkpoint(spec, ckpt.keys())}
    shard, shapes = Shard(ps.get_tensor_model_parallel_rank(), layout.tp), spec.shapes(layout.tp)
    n = 0
    for chunk in chunks:
        targets = checkpoint_tensors(chunk)
        missing = sorted(set(targets) - set(rows))
        if missing:
            raise UserError(
                f"HF checkpoint {ckpt.path} has no tensor for {len(missing)} of the {spec.architecture} model's "
                f"tensors on this rank: {', '.join(missing[:6])}"
            )
        written = set()
        for name, p in targets.items():
            row = rows[name]
            t = row.mapping.shard([ckpt.slice(h) for h in row.hf], shard, shapes)
            if tuple(t.shape) != tuple(p.shape):
                raise UserError(f"{name}: HF {row.hf} gives shape {tuple(t.shape)}, the model has {tuple(p.shape)}")
            p.data.copy_(t.to(p.dtype))
            written.add(name)
        require_all_written(targets, written, f"HF checkpoint {ckpt.path}")
        n += len(written)
    return n


def iter_tensors(
    chunks: Sequence[Any], spec: BridgeSpec, dtype: torch.dtype | None, value: Any | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (HF name, whole tensor) of every exported parameter, on the first
    data-parallel replica's first TP rank (nothing elsewhere)."""
    table = table_for(spec)
    layout = layout_of(chunks)
    shapes = spec.shapes(layout.tp)
    group = ps.get_tensor_model_parallel_group()
    if ps.get_data_parallel_rank(with_context_parallel=True) != 0:
        return
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if is_adapter_param(name):  # LoRA: exported by lora_modules, merged by `merged`
                continue
            row = resolve_megatron(table, name)
            if row is None:
                raise UserError(f"{name} has no row in the {spec.architecture} table")
            if not row.mapping.export:
                continue
            shards = gather_shards((p if value is None else value(p)).detach(), group)
            if shards is None:
                continue
            for hf_name, t in zip(row.hf, row.mapping.merge(shards, shapes)):
                yield hf_name, (t if dtype is None else t.to(dtype)).contiguous()


__all__ = ["iter_tensors", "load"]
