"""HF weights into and out of a live model: this rank's megatron chunks.

Loading and gathering are per backend (`LOADERS`, `EXPORTERS` by `spec.backend`; the hf
backend's are runtime/hf/weights.py); writing the directory is shared. The native backend's:

* `load_hf_weights(chunks, spec, path)` — coordinates from megatron's parallel_state, one
  `chunk_plan` per virtual chunk (bridge/loader.py, the converter's plan), names checked
  both ways (a parameter without a source, or a source without a parameter, is an error),
  each rank reading only its slices and copying them in.
* `export_hf_weights(chunks, spec, out_dir, source_dir=...)` — gathers each parameter's
  TP (or expert-TP) shards onto one replica, merges them back to HF names and shapes with
  the same table, and every writing rank streams its tensors into its own safetensors file
  as they are gathered (runtime/safetensors_stream.py: host memory holds one tensor, not a
  stage; the bytes equal `save_file`'s); rank 0 writes the index, config.json and copies
  the tokenizer files (runtime/hf_export.py: in the step, or behind the training loop).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.bridge.features.mtp import note_skipped
from megatron_bridge.bridge.hf_config import BridgeSpec
from megatron_bridge.bridge.layout import renumber
from megatron_bridge.bridge.loader import (
    HFCheckpoint,
    _write_config_and_assets,
    chunk_plan,
    resolve_checkpoint,
    shard_of,
    table_for,
)
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.convert.formats.manifest import INDEX_CRC32
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.build_base import later
from megatron_bridge.runtime.hf_export import HFExport
from megatron_bridge.runtime.weights_base import (
    Into,
    cast_free,
    cast_to,
    checkpoint_tensors,
    current_coords,
    gather_merged,
    gather_shards,
    handed_over,
    landing,
    layout_of,
    require_all_written,
    vp_stage_of,
)


def load_hf_weights(chunks: Sequence[Any], spec: BridgeSpec, path: str | Path | HFCheckpoint) -> int:
    """Copy HF weights into this rank's model chunks, by the loader of the model's backend
    (`LOADERS`). Returns the number of tensors loaded."""
    with torch.no_grad():
        if isinstance(path, HFCheckpoint):
            return LOADERS[spec.backend](chunks, spec, path)
        with HFCheckpoint(path) as ckpt:
            return LOADERS[spec.backend](chunks, spec, ckpt)


def _load_native(chunks: Sequence[Any], spec: BridgeSpec, ckpt: HFCheckpoint) -> int:
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
    (`EXPORTERS`). Every rank must iterate it to the end. Each tensor is new memory (gathered
    or cloned, never a view of a parameter), so a caller may keep it while training goes on
    (runtime/hf_export.py does). `value(param)` picks what is
    exported (default the weight; e.g. `lambda p: p.main_grad`). `everywhere`: every rank of
    a pipeline stage gathers and yields its stage's tensors, all in the same order (all-gathers
    instead of gathers; experts from every EP rank): what stream.py's broadcast mode sends on.
    `into` (weights_base.Into): where the caller wants named tensors to land (stream.py's
    layout="model": an expert's slot in its stacked tensor); the tensor yielded is then that
    destination, not new memory. Honoured only where no `dtype` cast intervenes."""
    return EXPORTERS[spec.backend](chunks, spec, dtype, value, everywhere, into=cast_free(into, dtype))


def _iter_native(
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


# each backend's rank-local loader and gathering exporter, by `BridgeSpec.backend` (the hf
# backend's imported when first used: runtime/build_base.later)
LOADERS: dict[str, Callable[[Sequence[Any], BridgeSpec, HFCheckpoint], int]] = {
    "native": _load_native,
    "hf": later("megatron_bridge.runtime.hf.weights:load"),  # deferred: transformers' modeling code
}
EXPORTERS: dict[str, Callable[..., Iterator[tuple[str, torch.Tensor]]]] = {
    "native": _iter_native,
    "hf": later("megatron_bridge.runtime.hf.weights:iter_tensors"),  # deferred: as above
}


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
    "EXPORTERS",
    "LOADERS",
    "checkpoint_tensors",
    "current_coords",
    "export_hf_weights",
    "gather_shards",
    "global_names",
    "iter_hf_tensors",
    "layout_of",
    "load_hf_weights",
    "require_all_written",
    "start_hf_export",
    "vp_stage_of",
]
