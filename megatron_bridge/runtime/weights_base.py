"""What every backend's HF loader and exporter shares: this rank's coordinates and layout, the
tensors a checkpoint must fill (and the proof that it did), gathering TP shards to one rank
(`gather_merged`: straight into the merged HF tensors, so a rank holds one copy of a tensor, not
its shards beside their merge)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from math import prod
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.bridge.mapping import Transform
from megatron_bridge.bridge.shards import Block, Shapes, Shard, out_shape
from megatron_bridge.errors import UserError


def current_coords(vp_stage: int | None = None) -> Coords:
    """This rank's coordinates in the initialized process groups (and virtual chunk)."""
    return Coords(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        vp_stage=vp_stage,
    )


def layout_of(chunks: Sequence[Any]) -> Layout:
    """The layout the chunks were built for (from their TransformerConfig)."""
    c = chunks[0].config
    return Layout(
        tp=c.tensor_model_parallel_size,
        pp=c.pipeline_model_parallel_size,
        cp=c.context_parallel_size,
        ep=c.expert_model_parallel_size,
        etp=c.expert_tensor_parallel_size,
        vpp=c.virtual_pipeline_model_parallel_size,
        sequence_parallel=c.sequence_parallel,
        layers_first_stage=c.num_layers_in_first_pipeline_stage,
        layers_last_stage=c.num_layers_in_last_pipeline_stage,
    )


def vp_stage_of(chunks: Sequence[Any], i: int) -> int | None:
    """The virtual pipeline stage of `chunks[i]` (None without VPP)."""
    return i if chunks[0].config.virtual_pipeline_model_parallel_size else None


def checkpoint_tensors(chunk: Any) -> dict[str, torch.Tensor]:
    """{name: tensor} of everything a weight checkpoint must fill in `chunk`: every parameter
    and every persistent buffer (a buffer derived from the config is registered
    non-persistent), LoRA adapters excepted (`lora_modules` initialises or loads them).
    A chunk built with `build_model(..., load_weights=True)` holds uninitialised memory in
    all of them until a loader writes them, which `require_all_written` then proves."""
    out = {k: p for k, p in chunk.named_parameters() if not is_adapter_param(k)}
    for mod_name, mod in chunk.named_modules():
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                name = f"{mod_name}.{b_name}" if mod_name else b_name
                if not is_adapter_param(name):
                    out.setdefault(name, b)
    return out


def require_all_written(targets: dict[str, Any], written: set[str], source: str) -> None:
    """The guarantee that makes skipping megatron's random init safe: every tensor of
    `targets` (`checkpoint_tensors`) was written by the loader, else a UserError naming them."""
    left = sorted(set(targets) - written)
    if left:
        raise UserError(
            f"{source} left {len(left)} tensor(s) of the model unloaded (they would keep uninitialised "
            f"memory): {', '.join(left[:8])}{' ...' if len(left) > 8 else ''}"
        )


def gather_shards(t: torch.Tensor, group, everywhere: bool = False) -> list[torch.Tensor] | None:
    """All shards on the group's first rank (None elsewhere), or on every rank (`everywhere`)."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [t.clone()]
    if everywhere:
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return parts
    dst = torch.distributed.get_global_rank(group, 0)
    me = torch.distributed.get_rank()
    out = [torch.empty_like(t) for _ in range(size)] if me == dst else None
    torch.distributed.gather(t.contiguous(), out, dst=dst, group=group)
    return out


# a shard's rows that do not land in place (a column range, a strided view, padding, many small
# blocks) travel in pieces of at most this many bytes through one receive buffer: the constant
# in the weight stream's memory bound (docs/rl.md "Memory")
GATHER_CHUNK_BYTES = 16 << 20
DIRECT_MAX_BLOCKS = 8  # more row blocks per shard than this (fused QKV of many groups) go chunked

# where a receiver wants an HF tensor to land: (HF name, shape, dtype, device) -> a contiguous
# tensor of that shape (e.g. its slot in a stacked experts tensor, stream.py's layout="model"),
# or None for new memory. An exporter handed one gathers the named tensor straight into it and
# yields that very tensor, so the receiver does not copy it from a second buffer.
Into = Callable[[str, tuple[int, ...], torch.dtype, torch.device], "torch.Tensor | None"]


def cast_free(into: Into | None, dtype: torch.dtype | None) -> Into | None:
    """`into` for an export cast to `dtype`: only a tensor gathered in that dtype lands in place
    (a cast makes new memory anyway, and the receiver's tensor is allocated in the cast dtype)."""
    if into is None or dtype is None:
        return into
    inner = into
    return lambda name, shape, dt, dev: inner(name, shape, dt, dev) if dt == dtype else None


def landing(into: Into | None, name: str | None, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """The memory a received tensor `name` of `shape` (dtype and device of `like`) goes to: where
    `into` wants it, or new memory (no `into`, no name, or a destination that does not fit)."""
    dest = None if into is None or name is None else into(name, shape, like.dtype, like.device)
    if dest is None or tuple(dest.shape) != shape or dest.dtype != like.dtype or not dest.is_contiguous():
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return dest


def _outs(
    hf_shapes: Sequence[tuple[int, ...]], t: torch.Tensor, names: Sequence[str], into: Into | None
) -> tuple[torch.Tensor, ...]:
    return tuple(landing(into, names[i] if i < len(names) else None, s, t) for i, s in enumerate(hf_shapes))


def _into_outs(merged: Sequence[torch.Tensor], t: torch.Tensor, names: Sequence[str], into: Into | None):
    """A merge made in new memory, moved to where `into` wants it (when it wants it somewhere)."""
    if into is None:
        return tuple(merged)
    outs = _outs([tuple(x.shape) for x in merged], t, names, into)
    for o, x in zip(outs, merged):
        if o.data_ptr() != x.data_ptr():
            o.copy_(x)
    return outs


def gather_merged(
    t: torch.Tensor,
    transform: Transform,
    shapes: Shapes,
    group,
    everywhere: bool = False,
    *,
    names: Sequence[str] = (),
    into: Into | None = None,
) -> tuple[torch.Tensor, ...] | None:
    """`transform.merge` of every rank's shard `t`, on the group's first rank (None elsewhere)
    or on every rank (`everywhere`), always new memory. Why not gather, then merge: the shards
    and their merge (and gloo's flat receive buffer) would be alive together, twice the tensor.
    Here the HF tensors are allocated once and each rank's rows are received into their place
    in them: a shard's blocks (`Transform.blocks`, the loader's description of where its rows
    come from) read backwards. A block that is a plain row range is received in place; the rest
    (a row-parallel column range, a strided view) pass through one buffer of at most
    `GATHER_CHUNK_BYTES`; a shard whose blocks read it as rows of another shape (`Block.view`:
    stacked experts split inside each expert) travels as those rows. A transform whose merge
    uses one rank's tensor alone (`whole`) moves nothing to the first rank; one that is not
    blockwise is gathered and merged as before.
    `into` (with the merged tensors' HF `names`): where the receiver wants them (`Into`)."""
    t = t.contiguous()
    n, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if transform.whole:
        got = _whole(t, transform, shapes, group, everywhere)
        return None if got is None else _into_outs(got, t, names, into)
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    hf_shapes = [tuple(x.shape) for x in transform.merge([meta] * n, shapes)]
    try:  # NotBlockwise, or shapes the blocks do not describe: gathered and merged (correct, 2x)
        plans = [transform.blocks(hf_shapes, Shard(i, n), shapes) for i in range(n)]
        rows = out_shape(plans[me], hf_shapes)  # the shard as its blocks describe it (a `view`: its rows)
        if any(out_shape(p, hf_shapes) != rows for p in plans) or prod(rows) != t.numel():
            raise ValueError(f"{transform!r}: blocks do not cover a {tuple(t.shape)} shard")
        t = t.view(rows)
    except ValueError:
        shards = gather_shards(t, group, everywhere)
        return None if shards is None else _into_outs(transform.merge(shards, shapes), t, names, into)
    receives = everywhere or me == 0
    outs = _outs(hf_shapes, t, names, into) if receives else ()
    for i, blocks in enumerate(plans):
        src = torch.distributed.get_global_rank(group, i)
        for a, b, dest in _pieces(blocks, t, outs):
            if i == me:
                if receives:
                    _place(blocks, a, t[a:b], outs)
                if everywhere:
                    torch.distributed.broadcast(t[a:b], src=src, group=group)
                elif me != 0:
                    torch.distributed.send(t[a:b], dst=torch.distributed.get_global_rank(group, 0), group=group)
                continue
            if not receives:
                continue
            buf = dest if dest is not None else torch.empty((b - a,) + t.shape[1:], dtype=t.dtype, device=t.device)
            if everywhere:
                torch.distributed.broadcast(buf, src=src, group=group)
            else:
                torch.distributed.recv(buf, src=src, group=group)
            if dest is None:
                _place(blocks, a, buf, outs)
    return outs if receives else None


def _plain(b: Block) -> bool:
    return b.src is not None and b.cols is None and not b.strided and not b.lead


def _pieces(blocks: list[Block], t: torch.Tensor, outs: tuple[torch.Tensor, ...]):
    """(first row, end row, the view of `outs` they land in or None) of a shard's rows, in the
    order they travel: its plain blocks one by one, or row chunks of `GATHER_CHUNK_BYTES`."""
    real = [b for b in blocks if b.src is not None]
    if all(_plain(b) for b in real) and len(real) <= DIRECT_MAX_BLOCKS:
        at = 0
        for b in blocks:
            if b.src is not None:
                yield at, at + b.n, outs[b.src][b.rows[0] : b.rows[1]] if outs else None
            at += b.n
        return
    row = max(1, t[:1].numel() * t.element_size())
    step = max(1, GATHER_CHUNK_BYTES // row)
    for a in range(0, t.shape[0], step):
        yield a, min(a + step, t.shape[0]), None


def _place(blocks: list[Block], a: int, rows: torch.Tensor, outs: tuple[torch.Tensor, ...]) -> None:
    """Copy a shard's rows [a, a + len(rows)) to where its blocks say they came from."""
    at, end = 0, a + rows.shape[0]
    for b in blocks:
        lo, hi = max(a, at), min(end, at + b.n)
        if b.src is not None and lo < hi:
            b.of(outs[b.src])[lo - at : hi - at].copy_(rows[lo - a : hi - a])
        at += b.n


def _whole(t: torch.Tensor, transform: Transform, shapes: Shapes, group, everywhere: bool):
    """A transform that merges the first rank's tensor alone: it stays there (a copy when the
    merge would return it as it is); with `everywhere` it is broadcast from there."""
    first = torch.distributed.get_rank(group) == 0
    if not (first or everywhere):
        return None
    got = t if first else torch.empty_like(t)
    if everywhere and torch.distributed.get_world_size(group) > 1:
        torch.distributed.broadcast(got, src=torch.distributed.get_global_rank(group, 0), group=group)
    merged = transform.merge([got], shapes)
    ptr = t.untyped_storage().data_ptr()
    return tuple(x.clone() if x.untyped_storage().data_ptr() == ptr else x for x in merged)


def handed_over(
    names: Sequence[str], merged: list[torch.Tensor], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, each tensor dropped from `merged` as it is handed over, so a cast
    copy is not held beside its source while the receiver keeps it (docs/rl.md "Memory"). As
    `zip`: no more pairs than tensors (a stacked experts tensor not yet complete has none)."""
    for name in names[: len(merged)]:
        yield name, cast_to(merged.pop(0), dtype)


def cast_to(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return (t if dtype is None else t.to(dtype)).contiguous()


__all__ = [
    "GATHER_CHUNK_BYTES",
    "Into",
    "cast_free",
    "cast_to",
    "handed_over",
    "checkpoint_tensors",
    "current_coords",
    "gather_merged",
    "gather_shards",
    "landing",
    "layout_of",
    "require_all_written",
    "vp_stage_of",
]
