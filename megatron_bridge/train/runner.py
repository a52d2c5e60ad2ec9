"""`python -m megatron_bridge.train recipe=X [overrides]`: the training entry point.

The same entry runs under `torchrun` and the `deepspeed` launcher (whose `--local_rank=N`
argument is dropped by `parse_args`). Order matters and is the product's promise: compose
and validate the whole config, then check data, tokenizer and checkpoint paths — all before
any process group or model exists, so bad input costs a second, not a launch. This module
does exactly that and imports no torch; the job itself (process groups, model, engine, data,
the training loop, export) is `job.py`, imported once the config has passed. Only rank 0
writes the run directory (resolved config, metrics, TensorBoard, wandb); all ranks agree
on it through a broadcast.

Failures end the job instead of hanging it (docs/reliability.md): a rank whose step or
checkpoint save raises prints `rank R failed in step N: <error>` before its traceback; a step
or save making no progress for `train.timeout_minutes` is ended by the watchdog
(reliability.py), which says where the rank is stuck; torchrun then stops the other ranks.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.backends.describe import describe
from megatron_bridge.backends.frozen_model import frozen_spec, objective_model
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.loader import hf_assets
from megatron_bridge.bridge.lora import base_of
from megatron_bridge.config.compose import compose
from megatron_bridge.config.schema import TrainRunConfig
from megatron_bridge.convert.formats.safetensors_io import scan_dir
from megatron_bridge.convert.sources.preflight import check_init_source
from megatron_bridge.data.indexed import check_indexed_data
from megatron_bridge.data.preference import check_preference_data
from megatron_bridge.errors import LayoutError, UserError, run_cli
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.runtime.lora_files import check_adapter_dir
from megatron_bridge.train import lease, manifest
from megatron_bridge.train.orphans import die_with_launcher


def interval_exports(out: str | Path) -> bool:
    """Whether directory `out` holds only interval exports (`iter_NNNNNNN/`, and unpublished
    `iter_NNNNNNN.tmp/` ones a stopped run left): what a resumed run may add to."""
    return all(p.is_dir() and re.fullmatch(r"iter_\d{7}(\.tmp)?", p.name) for p in Path(out).iterdir())


def preflight(cfg, dims, spec) -> None:
    """Cheap checks of everything on disk the run will need. Raises UserError."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and int(local) != cfg.cluster.gpus_per_node:
        raise UserError(
            f"this node runs {local} processes (LOCAL_WORLD_SIZE) but cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node}: TP groups would not line up with nodes. Start "
            f"--nproc-per-node {cfg.cluster.gpus_per_node} or set cluster.gpus_per_node={local}."
        )
    if cfg.data.kind in ("indexed", "sft"):  # sft: chat data, checked as indexed data (vocab, splits)
        check_indexed_data(cfg.data, model_vocab_size=spec.vocab_size)
    if cfg.data.kind == "preference":  # its two halves, each checked as chat data
        check_preference_data(cfg.data, spec.vocab_size)
    frozen = objective_model(cfg)  # a DPO reference or a teacher: its files hold data only, as init_from's
    if frozen is not None:
        check_init_source(frozen[1], arg=frozen[0], spec=frozen_spec(cfg, spec))
    if cfg.train.init_from and not Path(cfg.train.init_from).exists():
        raise UserError(
            f"train.init_from={cfg.train.init_from} does not exist. Point it at a Hugging Face model "
            "directory, an `mbr convert` output or a Megatron-LM / NeMo / Megatron-Bridge checkpoint, or drop "
            "train.init_from to start from scratch."
        )
    if cfg.train.init_from:  # HF headers and names, or a converted checkpoint's pickles: data only
        check_init_source(cfg.train.init_from, spec=spec)
    elif spec.source and any(Path(spec.source).glob("*.safetensors")):
        scan_dir(Path(spec.source))  # model.hf_path's weights: names confined, no FIFO
    for key, out in (("export_to", cfg.export_to), ("export_adapter_to", cfg.export_adapter_to)):
        if out and Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
            if key == "export_to" and cfg.checkpoint.resume and cfg.train.export_interval and interval_exports(out):
                continue  # a resumed run goes on adding to its own interval exports
            raise UserError(
                f"{key}={out} exists and is not empty; choose a new directory"
                + (
                    " (a resumed run with train.export_interval may reuse one that holds only its iter_NNNNNNN/ "
                    "exports)."
                    if key == "export_to"
                    else "."
                )
            )
    if cfg.train.export_interval and not cfg.export_to:
        raise UserError(
            f"train.export_interval={cfg.train.export_interval} writes export_to/iter_NNNNNNN/ every "
            f"{cfg.train.export_interval} steps, but export_to is not set. Add export_to=DIR."
        )
    if cfg.export_to:  # a model without HF weights cannot be exported: say so before training
        backend_of(spec).table(spec)
        if spec.source:  # the files copied along with the export (a link out of the directory is refused)
            hf_assets(Path(spec.source))
    _preflight_peft(cfg, spec)


def resolve_resume(cfg, dims, spec):
    """`cfg` with `checkpoint.resume` decided: True when this launch continues from the latest
    complete checkpoint, False when it starts as configured (none yet: `train.init_from`,
    `model.hf_path`'s weights or a random init, as without resume). Reads the
    latest pointer, the manifest and the layout it was written with, and checks that its pickles
    hold only data, before anything starts (every rank re-hashes the files at load and loads
    them as data only again: runtime/safe_load.py). Rank 0 says once which it is."""
    mode = cfg.checkpoint.resume
    if not mode:
        return cfg
    if not cfg.checkpoint.dir:
        raise UserError(
            f"checkpoint.resume={str(mode).lower()} needs checkpoint.dir=DIR (the directory the first run saved to)."
        )
    it, written = manifest.peek(cfg.checkpoint.dir)
    if it is None or written is None:  # both or neither: nothing to continue yet
        if os.environ.get("RANK", "0") == "0":
            start = cfg.train.init_from or spec.source or "random initialisation"
            print(
                f"checkpoint.resume={str(mode).lower()}: no checkpoint in {cfg.checkpoint.dir} yet; starting from {start}",
                flush=True,
            )
        return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=False))
    d = manifest.iter_dir(cfg.checkpoint.dir, it)
    manifest.check_meta(d, written, ckpt_meta(cfg, dims, spec))
    manifest.scan_pickles(d, written)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))


def _preflight_peft(cfg, spec) -> None:
    """LoRA inputs on disk: the adapter to start from must fit the base model."""
    if cfg.export_adapter_to and cfg.peft.method != "lora":
        raise UserError("export_adapter_to=DIR writes a LoRA adapter, but this run trains no adapter. Add peft=lora.")
    if cfg.peft.method == "lora" and cfg.peft.init_from:
        check_adapter_dir(cfg.peft.init_from, base_of(cfg, spec), cfg.peft)


def ckpt_meta(cfg, dims, spec) -> dict[str, Any]:
    """What a checkpoint must have been written with to be resumed (per-rank shards)."""
    model = (
        f"{spec.architecture} layers={spec.num_layers} hidden={spec.hidden_size} ffn={spec.ffn_hidden_size} "
        f"heads={spec.num_attention_heads}/{spec.num_query_groups} vocab={spec.vocab_size}"
    )  # the shapes a rank file's tensors have: another model fails in load_state_dict otherwise
    meta = {"layout": dims.describe(), "engine": cfg.train.engine, "model": model, "grid": grid_record(dims)}
    if cfg.peft.method != "none":  # adapters only: the checkpoint refers to its base model
        peft = f"{cfg.peft.method} r={cfg.peft.rank} {sorted(cfg.peft.target_modules)}"
        meta.update(peft=peft, base=base_of(cfg, spec))
    return meta


GRID = (
    "tp",
    "pp",
    "cp",
    "ep",
    "etp",
    "vpp",
    "layers_first_stage",
    "layers_last_stage",
    "world_size",
    "dp",
    "zero_stage",
)


def grid_record(dims) -> dict[str, Any]:
    """The `ParallelDims` fields that say which rank holds which shard: `mbr reshard` reads a
    checkpoint's rank files by them (train/ckpt_source.py)."""
    return {k: v for k, v in dataclasses.asdict(dims).items() if k in GRID}


def validate_for_launch(cfg, spec):
    """Every layout rule against the launcher's real world size (1 without a launcher), before
    torch is even imported. A world-size violation also says how many processes to start."""
    launcher = os.environ.get("WORLD_SIZE")
    world = int(launcher) if launcher else 1
    try:
        return validate(cfg, spec, world)[0]
    except LayoutError as e:
        if any(v.rule == "world-size" for v in e.violations):
            d = ParallelDims.from_config(cfg, world, moe=spec.is_moe)
            need = d.model_parallel * (1 if d.dp_inferred else max(d.dp, 1))
            started = (
                f"the launcher started WORLD_SIZE={world} process(es)"
                if launcher
                else "it runs without a launcher, as 1 process"
            )
            e.args = (
                f"{e}\n  Launch: {started}; this layout needs {'a multiple of ' if d.dp_inferred else ''}{need}. "
                f"Start {need} processes (e.g. `torchrun --nproc-per-node {need} -m megatron_bridge.train ...` "
                "on one node, or `mbr launch` for several), or change the degrees.",
            )
        raise


def train(argv: Sequence[str], *, finalize: bool = True) -> int:
    """Run one training job: build → resume → loop → export. `finalize=False` keeps the
    default process group alive (tests that run several layouts in one launch)."""
    die_with_launcher()  # a rank ends itself when its launcher dies (orphans.py)
    cfg, args = compose(argv, schema=TrainRunConfig)
    spec = describe(cfg.model)  # the one model description (config.json read here, once)
    dims = validate_for_launch(cfg, spec)  # every layout rule, before anything starts
    preflight(cfg, dims, spec)
    cfg = resolve_resume(cfg, dims, spec)
    lease.acquire(cfg)  # one job per checkpoint.dir, refused before any process group (lease.py)

    from megatron_bridge.train import job  # torch and megatron load only once the config is known good

    # The imports' ~1 M objects (torch, megatron-core, transformers) leave the cyclic GC's
    # generations: its full collections during training would walk them for nothing.
    gc.freeze()
    job.run(cfg, dims, spec, args.recipe, ckpt_meta(cfg, dims, spec), finalize=finalize)
    return 0


def main(argv: list[str] | None = None) -> int:
    code = run_cli(train, list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        sys.exit(code)
    return code
