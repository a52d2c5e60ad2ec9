"""HF weights into and out of the native backend's GPTModel chunks (runtime/weights.py dispatches here).

* `load` — coordinates from megatron's parallel_state, one `chunk_plan` per virtual chunk
  (bridge/loader.py, the converter's plan), names checked both ways (a parameter without a
  source, or a source without a parameter, is an error), each rank reading only its slices and
  copying them in.
* `iter_tensors` — gathers each parameter's TP (or expert-TP) shards onto one replica and merges
  them back to HF names and shapes with the same table; stacked experts (GPT-OSS) assembled
  into their whole HF tensor expert by expert.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.bridge.layout import renumber
from megatron_bridge.bridge.loader import HFCheckpoint, chunk_plan, resolve_checkpoint, shard_of, table_for
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.weights_base import (
    Into,
    cast_to,
    checkpoint_tensors,
    current_coords,
    gather_merged,
    handed_over,
    landing,
    layout_of,
    require_all_written,
    vp_stage_of,
)


def load(chunks: Sequence[Any], spec: BridgeSpec, ckpt: HFCheckpoint) -> int:
    layout = layout_of(chunks)
    rows = resolve_checkpoint(spec, ckpt.keys())
    n = 0
    for i, chunk in enumerate(chunks):
        coords = current_coords(vp_stage_of(chunks, i))
        plan = chunk_plan(spec, layout, rows, coords)
        targets = checkpoint_tensors(chunk)
        missing = sorted(set(targets) - set(plan))
        extra = sorted(set(plan) - set(targets))
        if missing or extra:  # before reading anything
            raise UserError(
                f"HF checkpoint {ckpt.path} does not match the {spec.family} model on this rank: "
                f"parameters without an HF source {missing[:6]}, HF rows without a parameter {extra[:6]}"
            )
        written = set()
        for local, row in plan.items():
            t = shard_of(row, [ckpt.slice(h) for h in row.hf], spec, layout, coords)
            p = targets[local]
            if tuple(t.shape) != tuple(p.shape):
                raise UserError(f"{local}: HF {row.hf} gives shape {tuple(t.shape)}, the model has {tuple(p.shape)}")
            p.data.copy_(t.to(p.dtype))
            written.add(local)
        require_all_written(targets, written, f"HF checkpoint {ckpt.path}")
        n += len(written)
    return n


def global_names(chunk: Any) -> dict[str, str]:
    """{local param name: global name} for one chunk (layer and expert offsets applied)."""
    layers = chunk.decoder.layers
    layer_off = layers[0].layer_number - 1 if len(layers) else 0
    c = chunk.config
    expert_off = (
        ps.get_expert_model_parallel_rank() * (c.num_moe_experts // c.expert_model_parallel_size)
        if c.num_moe_experts
        else 0
    )
    return {name: renumber(name, layer_off, expert_off) for name, _ in chunk.named_parameters()}


def iter_tensors(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    dtype: torch.dtype | None,
    value: Any | None,
    everywhere: bool = False,
    *,
    into: Into | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    table = table_for(spec)
    layout = layout_of(chunks)
    shapes = spec.shapes(layout.tp)
    stacks: dict[str, tuple[torch.Tensor, set[int]]] = {}  # stacked-experts HF tensors being assembled
    dense_writer = everywhere or ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_writer = (everywhere or ps.get_expert_data_parallel_rank() == 0) if spec.is_moe else False
    for chunk in chunks:
        names = global_names(chunk)
        for local, p in chunk.named_parameters():
            if is_adapter_param(local):  # LoRA: exported by lora_modules, merged by `merged`
                continue
            row = resolve_megatron(table, names[local])
            if row is None:
                raise UserError(f"megatron parameter {names[local]} has no row in the {spec.family} table")
            if not row.mapping.export:
                continue
            expert = row.mapping.is_expert
            if not (expert_writer if expert else dense_writer):
                continue
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            tf = row.mapping.transform
            t = (p if value is None else value(p)).detach()
            if tf.stacked:  # one expert's slab of an HF tensor that holds them all (GPT-OSS)
                whole = list(_stack_experts(row, t, shapes, group, spec, stacks, into, everywhere))
                yield from handed_over(row.hf, whole, dtype)
                continue
            got = gather_merged(t, tf, shapes, group, everywhere, names=row.hf, into=into)
            del t
            if got is None:
                continue
            merged = list(got)
            del got
            if expert and everywhere:  # every EP rank's experts, in EP rank order
                yield from _every_ep_rank(table, names[local], merged, spec, dtype, into)
                continue
            yield from handed_over(row.hf, merged, dtype)


def _every_ep_rank(
    table: Any,
    name: str,
    merged: Sequence[torch.Tensor],
    spec: BridgeSpec,
    dtype: torch.dtype | None,
    into: Into | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """A per-expert row in `everywhere` mode: this local expert's tensors from every EP rank
    (they hold the same local index j, so their global expert is r·n_local + j), broadcast from
    each rank in turn: one received tensor at a time, not every rank's at once, each received
    where `into` wants it if it does."""
    group = ps.get_expert_model_parallel_group()
    ep, me = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    n_local = (spec.num_moe_experts or 0) // ep
    for r in range(ep):
        other = resolve_megatron(table, renumber(name, 0, (r - me) * n_local))
        assert other is not None, name
        src = torch.distributed.get_global_rank(group, r)
        for hf_name, t in zip(other.hf, merged):
            yield hf_name, cast_to(_broadcast_from(t, r == me, src, group, hf_name, into), dtype)


def _broadcast_from(t: torch.Tensor, mine: bool, src: int, group, name: str, into: Into | None) -> torch.Tensor:
    got = t if mine else landing(into, name, tuple(t.shape), t)
    torch.distributed.broadcast(got, src=src, group=group)
    return got


def _stack_experts(
    row: Resolved,
    t: torch.Tensor,
    shapes: Any,
    group: Any,
    spec: BridgeSpec,
    stacks: dict,
    into: Into | None = None,
    everywhere: bool = False,
) -> tuple:
    """Stacked-experts rows (one HF tensor holds every expert): this local expert's slab gathered
    over expert-TP (`group`) straight into its slot of the whole HF tensor, and every EP rank's
    slab of the same local index received into its own slot, on EP rank 0 (every rank with
    `everywhere`); the whole tensors once the last expert of the layer has arrived (empty until
    then, and always on other EP ranks). Every EP rank walks the same local names in the same
    order, so the transfers pair up. The whole tensor (allocated at its first slab, where `into`
    wants it if it does) is the only memory: no slab beside it, no list of every EP rank's."""
    ep_group = ps.get_expert_model_parallel_group()
    ep, me = torch.distributed.get_world_size(ep_group), torch.distributed.get_rank(ep_group)
    n_all = spec.num_moe_experts
    assert row.expert is not None and n_all is not None
    n_local = n_all // ep
    j = row.expert % n_local
    keep = everywhere or me == 0  # the ranks that assemble the whole tensors

    def slot(r: int) -> Callable[[str, tuple[int, ...], torch.dtype, torch.device], torch.Tensor]:  # an `Into`
        def at(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if name not in stacks:
                like = torch.empty(0, dtype=dtype, device=device)
                stacks[name] = (landing(into, name, (n_all * shape[0], *shape[1:]), like), set())
            e, k = r * n_local + j, shape[0]
            stacks[name][1].add(e)
            return stacks[name][0][e * k : (e + 1) * k]

        return at

    got = gather_merged(
        t, row.mapping.transform, shapes, group, everywhere, names=row.hf, into=slot(me) if keep else None
    )
    if got is None:
        return ()
    first = torch.distributed.get_global_rank(ep_group, 0)
    for name, mine in zip(row.hf, got):
        for r in range(ep):
            src = torch.distributed.get_global_rank(ep_group, r)
            dest = slot(r)(name, tuple(mine.shape), mine.dtype, mine.device) if keep else mine
            if r == me:
                if dest.data_ptr() != mine.data_ptr():  # gathered elsewhere (a slot that did not fit)
                    dest.copy_(mine)
                if everywhere:
                    torch.distributed.broadcast(mine, src=src, group=ep_group)
                elif me != 0:
                    torch.distributed.send(mine, dst=first, group=ep_group)
            elif everywhere:
                torch.distributed.broadcast(dest, src=src, group=ep_group)
            elif me == 0:
                torch.distributed.recv(dest, src=src, group=ep_group)
    if not keep or len(stacks[row.hf[0]][1]) < n_all:
        return ()
    return tuple(stacks.pop(n)[0] for n in row.hf)


__all__ = ["global_names", "iter_tensors", "load"]
