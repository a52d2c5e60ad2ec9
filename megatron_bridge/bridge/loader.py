"""Online load (HF safetensors -> this rank's megatron shards) and export (back to HF).

Two layers, so an offline converter can use the first without a model or process group:

* `rank_shards(spec, layout, ckpt, coords)` — pure: for one rank's coordinates, yield
  (rank-local megatron name, tensor) for every parameter that rank holds, reading only
  its slices from disk (`safe_open(...).get_slice`).
* `load_hf_weights(chunks, spec, path)` — the live model: coordinates from megatron's
  parallel_state, one `rank_shards` plan per virtual chunk, names checked both ways (a
  parameter without a source, or a source without a parameter, is an error), copied in.
* `export_hf_weights(chunks, spec, out_dir, source_dir=...)` — gathers each parameter's
  TP (or expert-TP) shards onto one replica, merges them back to HF names and shapes with
  the same table, and every writing rank saves its own safetensors file (no rank holds the
  whole model); rank 0 writes the index, config.json and copies the tokenizer files.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bridge.bridge.layout import Layout, local_experts, renumber, to_local_name
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.bridge.mapping import Shard
from megatron_bridge.bridge.registry import weight_family
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_hf, resolve_megatron
from megatron_bridge.convert.formats import fp8
from megatron_bridge.convert.formats.safetensors_io import LazySlice, PositionedReader, TensorInfo, scan_dir
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where tensors are made: resolving rows and shards is torch-free
    import torch

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


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
        block = fp8.block_size(json.loads(cfg.read_text()), str(self.path)) if cfg.is_file() else None
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


@dataclass(frozen=True)
class Coords:
    """One rank's place in the layout (and which virtual chunk)."""

    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    etp_rank: int = 0
    vp_stage: int | None = None

    def pre_process(self, layout: Layout) -> bool:
        return self.pp_rank == 0 and (self.vp_stage or 0) == 0

    def post_process(self, layout: Layout) -> bool:
        last_vp = (layout.vpp or 1) - 1 if layout.pp > 1 else 0
        return self.pp_rank == layout.pp - 1 and (self.vp_stage or 0) == last_vp


def table_for(spec: BridgeSpec):
    return weight_family(spec.family).mappings(spec)


def resolve_checkpoint(spec: BridgeSpec, keys: Sequence[str]) -> list[Resolved]:
    """Every table row the checkpoint fills; unknown HF tensors are an error, not ignored
    (multi-token-prediction layers, which the bridge does not build, are skipped with a note)."""
    from megatron_bridge.bridge.features.mtp import mtp_keys, note_skipped

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


def owned(row: Resolved, spec: BridgeSpec, layout: Layout, coords: Coords, layers: range) -> str | None:
    """The rank-local name of `row` on the chunk at `coords`, or None if it lives elsewhere.

    megatron's structure, not a family's: the embedding sits in the first chunk, the final
    norm and output layer in the last; a tied output layer exists only when those differ."""
    name = row.megatron
    pre, post = coords.pre_process(layout), coords.post_process(layout)
    if name.startswith("embedding."):
        return name if pre else None
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        if not post or (name.startswith("output_layer.") and spec.tie_word_embeddings and pre):
            return None
        return name
    experts = None
    if row.mapping.is_expert:
        assert spec.num_moe_experts is not None  # expert rows apply to MoE specs only
        experts = local_experts(spec.num_moe_experts, layout.ep, coords.ep_rank)
    return to_local_name(name, layers, experts)


def chunk_plan(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved], coords: Coords) -> dict[str, Resolved]:
    """{rank-local megatron name: row} for the chunk at `coords`."""
    layers = layout.stage_layers(spec.num_layers, coords.pp_rank, coords.vp_stage)
    plan = {}
    for r in rows:
        local = owned(r, spec, layout, coords, layers)
        if local is not None:
            plan[local] = r
    return plan


def shard_for(row: Resolved, layout: Layout, coords: Coords) -> Shard:
    """Which piece of `row` the rank at `coords` holds: experts split over the expert-TP
    group, everything else over TP (for `Transform.blocks`, or `shard_of` with tensors)."""
    return Shard(coords.etp_rank, layout.etp) if row.mapping.is_expert else Shard(coords.tp_rank, layout.tp)


def shard_of(row: Resolved, tensors: Sequence[Any], spec: BridgeSpec, layout: Layout, coords: Coords) -> torch.Tensor:
    return row.mapping.shard(row.select(tensors), shard_for(row, layout, coords), spec.shapes(layout.tp))


def rank_shards(
    spec: BridgeSpec, layout: Layout, ckpt: HFCheckpoint, coords: Coords
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pure: (local name, tensor) of every parameter of the chunk at `coords`, one at a time."""
    for local, row in chunk_plan(spec, layout, resolve_checkpoint(spec, ckpt.keys()), coords).items():
        yield local, shard_of(row, [ckpt.slice(n) for n in row.hf], spec, layout, coords)


# ----------------------------------------------------------------------------------------
# live model
# ----------------------------------------------------------------------------------------


def current_coords(vp_stage: int | None = None) -> Coords:
    from megatron.core import parallel_state as ps

    return Coords(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        vp_stage=vp_stage,
    )


def layout_of(chunks: Sequence[Any]) -> Layout:
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


def _vp(chunks: Sequence[Any], i: int) -> int | None:
    return i if chunks[0].config.virtual_pipeline_model_parallel_size else None


def load_hf_weights(chunks: Sequence[Any], spec: BridgeSpec, path: str | Path | HFCheckpoint) -> int:
    """Copy HF weights into this rank's model chunks. Returns the number of tensors loaded."""
    import torch

    with torch.no_grad():
        return _load(chunks, spec, path)


def _load(chunks: Sequence[Any], spec: BridgeSpec, path: str | Path | HFCheckpoint) -> int:
    if not isinstance(path, HFCheckpoint):
        with HFCheckpoint(path) as ckpt:
            return _load(chunks, spec, ckpt)
    ckpt = path
    layout = layout_of(chunks)
    rows = resolve_checkpoint(spec, ckpt.keys())
    n = 0
    for i, chunk in enumerate(chunks):
        coords = current_coords(_vp(chunks, i))
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


def _global_names(chunk: Any) -> dict[str, str]:
    """{local param name: global name} for one chunk (layer and expert offsets applied)."""
    from megatron.core import parallel_state as ps

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
    chunks: Sequence[Any], spec: BridgeSpec, dtype: torch.dtype | None = None, value: Any | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective over all ranks: gather every exported parameter's shards to one replica and
    yield (HF name, full HF tensor) there. Every rank must iterate it to the end.
    `value(param)` picks what is exported (default the weight; e.g. `lambda p: p.main_grad`)."""
    from megatron.core import parallel_state as ps

    table = table_for(spec)
    layout = layout_of(chunks)
    shapes = spec.shapes(layout.tp)
    stacks: dict[str, dict[int, torch.Tensor]] = {}  # stacked-experts HF tensors being assembled
    dense_writer = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_writer = ps.get_expert_data_parallel_rank() == 0 if spec.is_moe else False
    for chunk in chunks:
        names = _global_names(chunk)
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
            shards = _gather((p if value is None else value(p)).detach(), group)
            if shards is None:
                continue
            merged = row.mapping.merge(shards, shapes)
            if row.mapping.transform.stacked:
                merged = _stack_experts(row, merged, spec, stacks)
            for name, t in zip(row.hf, merged):
                yield name, (t if dtype is None else t.to(dtype)).contiguous()


def _stack_experts(row: Resolved, slabs: Sequence[torch.Tensor], spec: BridgeSpec, stacks: dict) -> tuple:
    """Stacked-experts rows (one HF tensor holds every expert): gather this local expert's
    slab from every EP rank onto EP rank 0 and return the whole HF tensors once the last
    expert of the layer has arrived (empty until then, and always on other EP ranks). Every
    EP rank walks the same local names in the same order, so the gathers pair up."""
    import torch
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    ep = torch.distributed.get_world_size(group)
    n_all = spec.num_moe_experts
    assert row.expert is not None and n_all is not None
    n_local = n_all // ep
    j = row.expert % n_local
    got = [_gather(s, group) for s in slabs]
    if got[0] is None:
        return ()
    for name, per_rank in zip(row.hf, got):
        have = stacks.setdefault(name, {})
        for r, t in enumerate(per_rank or ()):
            have[r * n_local + j] = t
    if len(stacks[row.hf[0]]) < n_all:
        return ()
    done = [stacks.pop(n) for n in row.hf]
    return tuple(torch.cat([d[e] for e in range(n_all)], dim=0) for d in done)


def _gather(t: torch.Tensor, group) -> list[torch.Tensor] | None:
    """All shards on the group's first rank (None elsewhere)."""
    import torch

    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [t.clone()]
    dst = torch.distributed.get_global_rank(group, 0)
    me = torch.distributed.get_rank()
    out = [torch.empty_like(t) for _ in range(size)] if me == dst else None
    torch.distributed.gather(t.contiguous(), out, dst=dst, group=group)
    return out


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
    `model.safetensors.index.json`. config.json: `hf_config` if given, else the source's,
    else generated from the spec (`spec_to_hf_config`).
    Every non-weight file of `source_dir` (tokenizer, generation config) is copied."""
    import torch
    from safetensors.torch import save_file

    out = Path(out_dir)
    rank = torch.distributed.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    mine = dict(iter_hf_tensors(chunks, spec, dtype))
    listing: list[list[tuple[str, int]]] = [[] for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather_object(listing, sorted((k, v.numel() * v.element_size()) for k, v in mine.items()))
    writers = [r for r, names in enumerate(listing) if names]
    total = len(writers)
    seen: dict[str, int] = {}
    for r in writers:
        for k, _ in listing[r]:
            if k in seen:
                raise RuntimeError(f"{k} exported by ranks {seen[k]} and {r}")
            seen[k] = r
    torch.distributed.barrier()
    if mine:
        fname = f"model-{writers.index(rank) + 1:05d}-of-{total:05d}.safetensors"
        save_file(mine, str(out / fname), metadata={"format": "pt"})
    if rank == 0:
        weight_map, size = {}, 0
        for r in writers:
            fname = f"model-{writers.index(r) + 1:05d}-of-{total:05d}.safetensors"
            for k, nbytes in listing[r]:
                weight_map[k] = fname
                size += nbytes
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        _write_config_and_assets(out, spec, source_dir, hf_config, dtype)
        if spec.mtp_num_layers:
            from megatron_bridge.bridge.features.mtp import note_skipped

            note_skipped(spec, None)
    torch.distributed.barrier()
    return out


def _write_config_and_assets(out: Path, spec: BridgeSpec, source_dir, hf_config, dtype) -> None:
    if hf_config is None and source_dir is not None:
        hf_config = json.loads((Path(source_dir) / "config.json").read_text())
    if hf_config is None:
        from megatron_bridge.bridge.hf_config import spec_to_hf_config

        hf_config = spec_to_hf_config(spec)
    cfg = dict(hf_config)
    cfg.pop("quantization_config", None)  # exported weights are never quantised (an fp8 source reads as bf16)
    if dtype is not None:
        cfg["dtype"] = str(dtype).replace("torch.", "")
        cfg.pop("torch_dtype", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if source_dir is not None:
        for f in sorted(Path(source_dir).iterdir()):
            if f.is_file() and f.name != "config.json" and not f.name.endswith(WEIGHT_FILE_SUFFIXES):
                shutil.copy2(f, out / f.name)


__all__ = [
    "HFCheckpoint",
    "Coords",
    "shard_for",
    "shard_of",
    "rank_shards",
    "chunk_plan",
    "resolve_checkpoint",
    "load_hf_weights",
    "checkpoint_tensors",
    "require_all_written",
    "iter_hf_tensors",
    "export_hf_weights",
    "current_coords",
    "layout_of",
]
