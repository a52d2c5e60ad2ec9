"""`mbr export` and `mbr reshard` of a training checkpoint (`checkpoint.dir`), optimizer state included.

    mbr export  src=CKPT dst=HF model.hf_path=HF_SRC                   # the trained weights as HF
    mbr reshard src=CKPT dst=CKPT2 model.hf_path=HF_SRC parallel.tp=1 parallel.pp=2 cluster.gpus_per_node=2
    torchrun --nproc-per-node 2 -m megatron_bridge.train ... parallel.tp=1 parallel.pp=2 \\
        checkpoint.dir=CKPT2 checkpoint.resume=true                     # continues where CKPT stopped

The model is the one the run trained (`model.hf_path`, or the recipe's model group): the
checkpoint's manifest names it and a different one is refused. `mbr reshard` writes a training
checkpoint for the layout the composed recipe gives (`parallel.*`, `zero.stage`, `train.*` batch
sizes, and the world `cluster.nodes` × `cluster.gpus_per_node`, as `mbr check` reads them): the
same iteration, every rank's model chunks and its optimizer's state for its parameters — the fp32
main weights and Adam's moments, each merged over the old layout's TP (and EP) shards with the
weight's own transform and split for the new one (train/ckpt_source.py) — the LR schedule, and
the step. A run resuming it with that layout continues with the state the original run had.
Each rank file holds whole (TP-local) optimizer tensors, not a data-parallel share: the run takes
its share on load and writes its own form at its next save. RNG states come from the source's
rank 0 (a different split draws different dropout masks anyway). `format=torch|torch_dist`
writes the weights alone as a converted checkpoint instead. Peak memory: one pipeline stage's
weights and optimizer state, merged, at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.backends.describe import describe
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.loader import _write_config_and_assets, shard_of
from megatron_bridge.convert.formats.manifest import dtype_name
from megatron_bridge.convert.pipeline.options import check_format, check_workers, checked_layout
from megatron_bridge.convert.pipeline.options import describe as describe_layout
from megatron_bridge.convert.pipeline.progress import Progress
from megatron_bridge.convert.pipeline.run import _manifest, atomic_output, check_paths
from megatron_bridge.convert.pipeline.writers import DistOut, HFOut, TorchOut
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.parallel.topology import Topology
from megatron_bridge.train.checkpoint import write_state
from megatron_bridge.train.ckpt_source import TrainingCheckpoint, TrainingSource
from megatron_bridge.train.manifest import LATEST, MANIFEST, atomic_write_bytes, iter_dir
from megatron_bridge.train.runner import ckpt_meta

TRAINING = "training"  # `format=`: another layout's training checkpoint (the default for a training source)


def _open(cfg: Any) -> tuple[Path, Path, Any, TrainingCheckpoint]:
    src, dst = check_paths(cfg.src, cfg.dst, cfg.overwrite)
    spec = describe(cfg.model)
    model = ckpt_meta(cfg, Layout(), spec)["model"]
    return src, dst, spec, TrainingCheckpoint(src, spec, model)


def export_training(cfg: Any) -> int:
    """The trained weights of a training checkpoint as an HF directory (config.json and tokenizer
    files from the model's HF directory, when it has one)."""
    if not cfg.max_shard_gb > 0:
        raise UserError(f"max_shard_gb={cfg.max_shard_gb} must be > 0")
    src, dst, spec, ckpt = _open(cfg)
    source = TrainingSource(ckpt)
    writer = HFOut(int(cfg.max_shard_gb * 1e9), check_workers(cfg.workers))
    tensors, nbytes = writer.total(source)
    dtypes = {source.out_dtype(n) for n in source.tensors}
    with atomic_output(dst, cfg.overwrite) as tmp:
        with Progress("exported", tensors, nbytes, cfg.progress) as prog:
            writer.write(tmp, source, prog.advance)
        _write_config_and_assets(tmp, spec, spec.source, None, next(iter(dtypes)) if len(dtypes) == 1 else None)
    print(prog.summary(str(dst), f"HF safetensors, {dtype_name(dtypes)}, step {ckpt.iteration} of {src}"), flush=True)
    return 0


def reshard_training(cfg: Any) -> int:
    """A training checkpoint -> another layout's training checkpoint (`format=training`, the
    default) or a converted checkpoint of its weights (`format=torch|torch_dist`)."""
    fmt = cfg.format or TRAINING
    if fmt != TRAINING:
        return _to_converted(cfg, check_format(fmt))
    src, dst, spec, ckpt = _open(cfg)
    dims = Layout.from_config(cfg, moe=spec.is_moe)
    validate(cfg, spec, dims.world_size)  # every rule training applies to this layout
    meta = ckpt_meta(cfg, dims, spec)
    if meta["engine"] != "megatron":
        raise UserError(f"train.engine={meta['engine']}: a resharded checkpoint is for the megatron engine")
    with atomic_output(dst, cfg.overwrite) as tmp:
        out = iter_dir(tmp, ckpt.iteration)
        out.mkdir()
        files = _write_ranks(ckpt, spec, dims, out)
        manifest = {"iteration": ckpt.iteration, "world_size": dims.world_size, "files": files, **meta}
        atomic_write_bytes(out / MANIFEST, json.dumps({**manifest, "resharded_from": str(src)}, indent=1).encode())
        atomic_write_bytes(tmp / LATEST, f"{ckpt.iteration}\n".encode())
    print(
        f"resharded the training checkpoint of step {ckpt.iteration}: {ckpt.manifest['layout']} -> "
        f"{dims.describe()} ({len(files)} rank files, optimizer state included) -> {dst}",
        flush=True,
    )
    return 0


def _to_converted(cfg: Any, fmt: str) -> int:
    """The weights alone as an `mbr convert` output (either format) for `parallel.*`."""
    src, dst, spec, ckpt = _open(cfg)
    source = TrainingSource(ckpt)
    workers = check_workers(cfg.workers)
    layout = checked_layout(cfg, spec, {}, source.rows, source.tensors, fmt)
    writer = (DistOut if fmt == "torch_dist" else TorchOut)(spec, layout, workers)
    tensors, nbytes = writer.total(source)
    hf_config = read_hf_config(spec.source) if spec.source else backend_of(spec).hf_config(spec)
    with atomic_output(dst, cfg.overwrite) as tmp:
        with Progress("resharded", tensors, nbytes, cfg.progress) as prog:
            writer.write(tmp, source, prog.advance)
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        _manifest(fmt, hf_config, layout, source, tmp, [], src, "mbr reshard", workers)
    print(
        prog.summary(str(dst), f"training step {ckpt.iteration} -> {fmt}, {describe_layout(layout, None)}"), flush=True
    )
    return 0


def _write_ranks(ckpt: TrainingCheckpoint, spec: Any, dims: Any, out: Path) -> list[dict[str, Any]]:
    """Every rank file of `dims`, a pipeline stage at a time (the stage's rows merged once)."""
    backend, shapes = backend_of(spec), spec.shapes(ckpt.layout.tp)
    grid = Topology(dims).coords
    first = ckpt.states[0]
    chunks = [vp if dims.vpp else None for vp in range(dims.vpp or 1)]

    def held(rank: int, vp: int | None) -> dict[str, tuple[int, Any, Coords]]:
        """{table name: (table position, its name there, coordinates)} of one chunk of `rank`."""
        c = Coords(int(grid["tp"][rank]), int(grid["pp"][rank]), int(grid["ep"][rank]), int(grid["etp"][rank]), vp)
        layers = dims.stage_layers(spec.num_layers, c.pp_rank, vp)
        out = {}
        for pos, r in enumerate(ckpt.rows):
            local = backend.owned(spec, r, dims, c, layers)
            if local is not None:
                out[r.megatron] = (pos, local, c)
        return out

    files: list[dict[str, Any]] = []
    for pp in range(dims.pp):
        ranks = [r for r in range(dims.world_size) if int(grid["pp"][r]) == pp]
        plan = {rank: [held(rank, vp) for vp in chunks] for rank in ranks}
        rows = {r.megatron: r for r in ckpt.rows if any(r.megatron in h for hs in plan.values() for h in hs)}
        merged = {name: _merged(ckpt, r, shapes) for name, r in rows.items()}
        for rank in ranks:
            model: list[dict] = []
            named: dict[str, dict[str, Any]] = {}
            for h in plan[rank]:
                entries: dict[str, tuple[int, object]] = {}
                for name, (pos, local, c) in h.items():
                    r, (weights, states) = rows[name], merged[name]
                    t = shard_of(r, weights, spec, dims, c).contiguous().clone()
                    entries[local] = (pos, t)
                    named[name] = {"range": (0, t.numel()), "shape": tuple(t.shape)} | {
                        k: v.clone() if not isinstance(v, list) else shard_of(r, v, spec, dims, c).reshape(-1).clone()
                        for k, v in states.items()
                    }
                post = Coords(pp_rank=pp, vp_stage=chunks[len(model)]).post_process(dims)
                model.append(backend.rank_state(spec, entries, post))
            state = {
                "engine": {"model": model, "optimizer": [{"named": named}], "scheduler": first["engine"]["scheduler"]},
                "rng": first["rng"],
                "step": first["step"],
            }
            files.append({"file": f"rank_{rank:05d}.pt", **write_state(out / f"rank_{rank:05d}.pt", state)})
            del state, model, named
        del merged
    return files


def _merged(ckpt: TrainingCheckpoint, row: Any, shapes: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """`row`'s weight and each optimizer state, merged to HF tensors (a 0-dim state as stored)."""
    weights = list(row.mapping.merge(ckpt.weight_shards(row), shapes))
    states: dict[str, Any] = {}
    for key in ckpt.state_keys(row):
        shards = ckpt.state_shards(row, key)
        states[key] = shards if isinstance(shards, torch.Tensor) else list(row.mapping.merge(shards, shapes))
    return weights, states


__all__ = ["TRAINING", "export_training", "reshard_training"]
