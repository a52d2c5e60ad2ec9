"""HF weights into and out of a transformers-backend model's chunks (`runtime/weights.py` dispatches here).

A chunk's tensors have the checkpoint's own names (global layer indices), so each is one row
of the backend's table (`TransformersBackend.table`: the transform says how the tensor splits over TP).
Loading reads only this rank's slices of the safetensors (`HFCheckpoint.slice`, the
converter's reader); export gathers each tensor's TP shards onto the first replica and merges
them back with the same transform, bit-exactly (the rows sharing one checkpoint tensor, a vision tower's
fused q/k/v, are joined once the last is merged: `Transform.piece`). A stacked experts tensor reads only this EP rank's experts'
checkpoint tensors (backends/transformers/experts.py); on export it goes expert by expert when the
checkpoint holds one tensor per expert (`_per_expert`), else it is gathered over the EP group.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.backends.transformers.backend import stage_pieces
from megatron_bridge.backends.transformers.checkpoint import EVERY
from megatron_bridge.backends.transformers.experts import StackedExperts
from megatron_bridge.bridge.layout import ep_part
from megatron_bridge.bridge.loader import HFTensors, resolve_checkpoint, table_for
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.bridge.mapping import join_pieces
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import resolve_megatron
from megatron_bridge.convert.sources.hf_view import ConvertedTensors
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.transformers.experts import gather_experts, is_expert
from megatron_bridge.runtime.weights_base import (
    Into,
    checkpoint_tensors,
    gather_merged,
    handed_over,
    layout_of,
    require_all_written,
)


def load(chunks: Sequence[Any], spec: BridgeSpec, ckpt: HFTensors) -> int:
    """Copy this rank's slices of every checkpoint tensor into `chunks`; returns how many.
    Every HF tensor must have a row (`resolve_checkpoint`), every chunk tensor a source."""
    layout = layout_of(chunks)
    rows = {r.megatron: r for r in resolve_checkpoint(spec, ckpt.keys())}
    shard, shapes = Shard(ps.get_tensor_model_parallel_rank(), layout.tp), spec.shapes(layout.tp)
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    n = 0
    for chunk in chunks:
        targets = checkpoint_tensors(chunk)
        missing = sorted(set(targets) - set(rows))
        if missing:
            raise UserError(
                f"{ckpt.path} has no tensor for {len(missing)} of the {spec.architecture} model's "
                f"tensors on this rank: {', '.join(missing[:6])}"
            )
        written = set()
        for name, p in targets.items():
            row = rows[name]
            per_expert = is_expert(p) and isinstance(row.mapping.transform, StackedExperts)
            hf = ep_part(row.hf, ep, ep_rank) if per_expert else row.hf  # this EP rank's experts' tensors only
            t = row.mapping.shard([ckpt.slice(h) for h in hf], shard, shapes)
            if is_expert(p) and not per_expert:  # stacked in the checkpoint too: this rank's rows of dim 0
                t = ep_part(t, ep, ep_rank)
            if tuple(t.shape) != tuple(p.shape):
                raise UserError(f"{name}: HF {row.hf} gives shape {tuple(t.shape)}, the model has {tuple(p.shape)}")
            p.data.copy_(t.to(p.dtype))
            written.add(name)
        require_all_written(targets, written, str(ckpt.path))
        n += len(written)
    return n


def load_converted(chunks: Sequence[Any], spec: BridgeSpec, path: Path, man: Any) -> None:
    """An `mbr convert` / `mbr reshard` output of this model (any format, written at any layout)
    into this rank's chunks: its HF tensors (convert/sources/hf_view.py) cut as `load` cuts an HF
    directory's."""
    with ConvertedTensors(path) as tensors:
        load(chunks, spec, tensors)


def iter_tensors(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    dtype: torch.dtype | None,
    value: Any | None,
    everywhere: bool = False,
    *,
    into: Into | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: (HF name, whole tensor) of every exported parameter and persistent buffer
    (what `load` filled), on the first data-parallel replica's first TP rank (nothing elsewhere;
    `everywhere`: on every rank of the stage); gathered where `into` wants them (runtime/weights.py)."""
    table = table_for(spec)
    layout = layout_of(chunks)
    shapes = spec.shapes(layout.tp)
    group = ps.get_tensor_model_parallel_group()
    first = everywhere or ps.get_data_parallel_rank(with_context_parallel=True) == 0
    pieces: dict[str, dict[int, torch.Tensor]] = {}  # a checkpoint tensor shared by rows: its pieces so far
    # held by every chunk (a rotary module's persistent buffer, Mistral-Large-4's alpha): the first stage's is exported
    every = {n for n, where in stage_pieces(spec).items() if where == EVERY} if not everywhere else set()
    later = ps.get_pipeline_model_parallel_rank() > 0
    for i, chunk in enumerate(chunks):
        for name, p in checkpoint_tensors(chunk).items():  # persistent buffers too (Apertus' xIELU beta)
            if is_adapter_param(name) or (name in every and (i or later)):  # LoRA: lora_modules exports it
                continue
            row = resolve_megatron(table, name)
            if row is None:
                raise UserError(f"{name} has no row in the {spec.architecture} table")
            if not row.mapping.export:
                continue
            t = (p if value is None else value(p)).detach()
            if is_expert(p) and isinstance(row.mapping.transform, StackedExperts):
                yield from _per_expert(t, row, shapes, first, everywhere, dtype, into)
                continue
            if is_expert(p):  # every EP rank takes part: the first replica may hold a few of the experts
                t = gather_experts(t)
            if not first:
                continue
            piece = row.mapping.transform.piece
            got = gather_merged(t, row.mapping.transform, shapes, group, everywhere, names=row.hf, into=into)
            del t
            if got is not None and piece is not None:  # joined once its every piece is in (one stage holds them)
                held = pieces.setdefault(row.hf[0], {})
                held[piece[0]] = got[0]
                if len(held) < piece[1]:
                    continue
                got = (join_pieces([held[i] for i in sorted(pieces.pop(row.hf[0]))]),)
            if got is not None:
                yield from handed_over(row.hf, list(got), dtype)


def _per_expert(
    t: torch.Tensor,
    row: Any,
    shapes: Any,
    first: bool,
    everywhere: bool,
    dtype: torch.dtype | None,
    into: Into | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stacked experts tensor whose checkpoint holds one tensor per expert: expert by expert,
    each EP rank's slab broadcast over the EP group (every EP rank takes part), then gathered
    over TP and merged into that expert's HF tensors — a rank holds one expert's tensors, not
    the layer's every expert gathered whole (docs/rl.md "Memory")."""
    tf = row.mapping.transform
    one = StackedExperts(1, tf.pieces, tf.split)
    group, tp = ps.get_expert_model_parallel_group(), ps.get_tensor_model_parallel_group()
    ep, me = group.size(), group.rank()
    for r in range(ep):
        names = ep_part(row.hf, ep, r)
        for j in range(t.shape[0]):
            slab = t[j : j + 1].contiguous() if r == me else torch.empty_like(t[j : j + 1])
            torch.distributed.broadcast(slab, src=torch.distributed.get_global_rank(group, r), group=group)
            mine = names[j * tf.pieces : (j + 1) * tf.pieces]
            got = gather_merged(slab, one, shapes, tp, everywhere, names=mine, into=into) if first else None
            del slab
            if got is not None:
                yield from handed_over(mine, list(got), dtype)


__all__ = ["iter_tensors", "load", "load_converted"]
