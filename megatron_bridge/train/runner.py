"""`python -m megatron_bridge.train recipe=X [overrides]`: the training entry point.

The same entry runs under `torchrun` and the `deepspeed` launcher (whose `--local_rank=N`
argument is dropped by `parse_args`). Order matters and is the product's promise: compose
and validate the whole config, then check data, tokenizer and checkpoint paths — all before
any process group or model exists, so bad input costs a second, not a launch. Only rank 0
writes the run directory (resolved config, metrics, TensorBoard, wandb); all ranks agree
on it through a broadcast. The layout is validated before torch is even imported.

Failures end the job instead of hanging it (docs/reliability.md): a rank whose step or
checkpoint save raises prints `rank R failed in step N: <error>` before its traceback; a step
or save making no progress for `train.timeout_minutes` is ended by the watchdog
(reliability.py), which says where the rank is stuck; torchrun then stops the other ranks.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.config.compose import compose, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.errors import UserError
from megatron_bridge.reliability import Watchdog, failure_message, faulty_iterator, planned


@dataclasses.dataclass
class TrainRunConfig(Config):
    run_dir: str | None = None  # default runs/<recipe>/<timestamp>, chosen by rank 0
    export_to: str | None = None  # write an HF model here after training


def preflight(cfg, dims) -> None:
    """Cheap checks of everything on disk the run will need. Raises UserError."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and int(local) != cfg.cluster.gpus_per_node:
        raise UserError(
            f"this node runs {local} processes (LOCAL_WORLD_SIZE) but cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node}: TP groups would not line up with nodes. Start "
            f"--nproc-per-node {cfg.cluster.gpus_per_node} or set cluster.gpus_per_node={local}."
        )
    if cfg.data.kind == "indexed":
        from megatron_bridge.data.indexed import check_indexed_data

        check_indexed_data(cfg.data, model_vocab_size=cfg.model.vocab_size)
    if cfg.train.init_from and not Path(cfg.train.init_from).exists():
        raise UserError(
            f"train.init_from={cfg.train.init_from} does not exist. Point it at a Hugging Face model "
            "directory or an `mbr convert` output, or drop train.init_from to start from scratch."
        )
    if cfg.checkpoint.resume and not cfg.checkpoint.dir:
        raise UserError("checkpoint.resume=true needs checkpoint.dir=DIR (the directory the first run saved to).")
    if cfg.checkpoint.resume:
        # The latest pointer, the manifest and the layout it was written with, before anything
        # starts (the checksums are verified at load, by every rank).
        from megatron_bridge.train import checkpoint as ckpt

        it, manifest = ckpt.peek(cfg.checkpoint.dir)
        if it is not None:
            ckpt.check_meta(ckpt.iter_dir(cfg.checkpoint.dir, it), manifest, _ckpt_meta(cfg, dims))
    if cfg.export_to and Path(cfg.export_to).exists() and any(Path(cfg.export_to).iterdir()):
        raise UserError(f"export_to={cfg.export_to} exists and is not empty; choose a new directory.")
    if cfg.export_to:  # a family without HF weights cannot be exported: say so before training
        from megatron_bridge.bridge.registry import weight_family

        weight_family(cfg.model.family)


def _ckpt_meta(cfg, dims) -> dict[str, Any]:
    """What a checkpoint must have been written with to be resumed (per-rank shards)."""
    return {"layout": dims.describe(), "engine": cfg.train.engine}


def _run_dir(cfg, recipe: str) -> Path:
    import torch.distributed as dist

    obj = [cfg.run_dir or f"runs/{recipe}/{time.strftime('%Y%m%d-%H%M%S')}"]
    dist.broadcast_object_list(obj, src=0)
    return Path(obj[0])


def model_overrides(cfg) -> dict[str, Any]:
    """TransformerConfig settings of this run (precision, recompute) on top of what the
    model spec and the layout give (`bridge.hf_config.transformer_config_kwargs`)."""
    import torch

    t = cfg.train
    bf16 = t.precision == "bf16" or (t.precision == "auto" and torch.cuda.is_available())
    out: dict[str, Any] = {"bf16": bf16}
    if bf16:
        out["params_dtype"] = torch.bfloat16
    if t.recompute == "selective":
        out["recompute_granularity"] = "selective"
    elif t.recompute == "full":
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return out


def _rng_state() -> dict[str, Any]:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(s: dict[str, Any]) -> None:
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])


def validate_for_launch(cfg):
    """Every layout rule against the launcher's real world size (1 without a launcher), before
    torch is even imported. A world-size violation also says how many processes to start."""
    from megatron_bridge.errors import LayoutError
    from megatron_bridge.parallel.dims import ParallelDims, validate

    launcher = os.environ.get("WORLD_SIZE")
    world = int(launcher) if launcher else 1
    try:
        return validate(cfg, world)[0]
    except LayoutError as e:
        if any(v.rule == "world-size" for v in e.violations):
            d = ParallelDims.from_config(cfg, world)
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
    """Run one training job. `finalize=False` keeps the default process group alive (tests
    that run several layouts in one launch)."""
    cfg, args = compose(argv, schema=TrainRunConfig)
    dims = validate_for_launch(cfg)  # every layout rule, before anything starts
    preflight(cfg, dims)

    import torch
    from megatron.core import parallel_state as ps

    from megatron_bridge.bridge.hf_config import spec_from_model_config
    from megatron_bridge.bridge.model import build_model
    from megatron_bridge.data.loader import build_datasets, make_iterator
    from megatron_bridge.parallel import groups
    from megatron_bridge.train import checkpoint as ckpt
    from megatron_bridge.train.engines import DeepSpeedEngine, MegatronEngine
    from megatron_bridge.train.metrics import MetricsLogger

    mpu = groups.initialize(dims, timeout_minutes=cfg.train.timeout_minutes, seed=cfg.train.seed)
    rank = torch.distributed.get_rank()
    run_dir = _run_dir(cfg, args.recipe)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))

    spec = spec_from_model_config(cfg.model)
    overrides = model_overrides(cfg)
    chunks = build_model(spec, dims, **overrides)
    if cfg.model.hf_path and not cfg.train.init_from and not cfg.checkpoint.resume:
        from megatron_bridge.bridge.loader import load_hf_weights

        load_hf_weights(chunks, spec, cfg.model.hf_path)
    elif cfg.train.init_from:
        from megatron_bridge.train.init import load_initial_weights

        load_initial_weights(chunks, spec, cfg.train.init_from)

    if cfg.train.engine == "deepspeed":
        engine = DeepSpeedEngine(cfg, dims, chunks, mpu, bf16=overrides["bf16"])
    else:
        engine = MegatronEngine(cfg, dims, chunks)

    datasets = build_datasets(
        cfg.data,
        dims,
        seq_length=cfg.train.seq_length,
        seed=cfg.train.seed,
        train_steps=cfg.train.steps,
        model_vocab_size=cfg.model.vocab_size,
        valid_samples=0,
    )
    dp_rank = ps.get_data_parallel_rank()
    cp_rank = ps.get_context_parallel_rank()
    start = 0
    meta = _ckpt_meta(cfg, dims)
    if cfg.checkpoint.resume:
        it, state = ckpt.load(cfg.checkpoint.dir, meta)
        if it is not None:
            engine.load_state_dict(
                state["engine"], directory=state["_dir"]
            ) if cfg.train.engine == "deepspeed" else engine.load_state_dict(state["engine"])
            _set_rng_state(state["rng"])
            start = it
            if rank == 0:
                print(f"resumed from {state['_dir']} (step {it})", flush=True)

    def make_iterators(step: int):
        consumed = step * dims.global_batch_size
        return lambda n: [
            make_iterator(datasets.train, dims, dp_rank=dp_rank, cp_rank=cp_rank, consumed_samples=consumed)
            for _ in range(n)
        ]

    logger = MetricsLogger(
        run_dir, cfg.train.steps, enabled=rank == 0, config={"layout": dims.describe(), "recipe": args.recipe}
    )
    tokens_per_step = dims.global_batch_size * cfg.train.seq_length
    save_every = cfg.checkpoint.save_interval
    timeout_s = cfg.train.timeout_minutes * 60
    watchdog = Watchdog(timeout_s, rank, hint=f"train.timeout_minutes={cfg.train.timeout_minutes:g}")
    phase = "training"
    try:
        stop = cfg.train.steps if cfg.train.exit_after is None else min(cfg.train.steps, start + cfg.train.exit_after)
        for step in range(start, stop):
            phase = f"step {step + 1}"
            watchdog.arm(phase)
            t0 = time.perf_counter()
            iterators = make_iterators(step)
            if planned("step", step + 1):  # test-only fault injection (MBR_FAULT), see reliability.py
                iterators = _with_fault(iterators, step + 1, dims.grad_accum)
            loss, grad_norm, lr = engine.step(iterators)
            dt = time.perf_counter() - t0
            metrics = {
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "step_time": dt,
                "tokens_per_s": tokens_per_step / dt,
            }
            metrics.update(_gpu_metrics(spec, cfg, dims, dt))
            if (step + 1) % cfg.train.log_interval == 0 or step + 1 == cfg.train.steps:
                logger.log(step + 1, metrics)
            last = step + 1 == stop
            if cfg.checkpoint.dir and ((save_every and (step + 1) % save_every == 0) or last):
                phase = f"checkpoint save at step {step + 1}"
                watchdog.arm(phase)
                state = {"engine": engine.state_dict(), "rng": _rng_state(), "step": step + 1}
                ckpt.save(cfg.checkpoint.dir, step + 1, state, meta, extra=getattr(engine, "write_extra", None))
    except Exception as e:  # name the rank and the step before the launcher's summary
        if not isinstance(e, UserError):
            print(failure_message(rank, phase, e), file=sys.stderr, flush=True)
        raise
    finally:
        watchdog.close()
        logger.close()
    if cfg.export_to:
        from megatron_bridge.bridge.loader import export_hf_weights

        model_chunks = [m.module for m in engine.model] if hasattr(engine, "model") else [engine.module]
        export_hf_weights(model_chunks, spec, cfg.export_to, source_dir=cfg.model.hf_path)
        if rank == 0:
            print(f"exported Hugging Face model to {cfg.export_to}", flush=True)
    if finalize:
        groups.destroy()
    else:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    return 0


def _with_fault(make, step: int, micro_batches: int):
    """`make_iterators` whose first iterator fires the MBR_FAULT `step` fault mid-step."""

    def wrapped(n: int):
        its = make(n)
        its[0] = faulty_iterator(its[0], step, min(1, max(micro_batches - 1, 0)))
        return its

    return wrapped


def _gpu_metrics(spec, cfg, dims, dt: float) -> dict[str, float]:
    """MFU and memory, on GPU only (peak from cluster.peak_tflops)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    from megatron_bridge.plan.params import count  # exact parameter count

    n = count(cfg.model).active
    s, L, h = cfg.train.seq_length, cfg.model.num_layers, cfg.model.hidden_size
    flops_per_token = 6 * n + 12 * L * h * s  # dense matmuls + attention (Chinchilla / PaLM appendix)
    achieved = flops_per_token * dims.global_batch_size * s / dt / dims.world_size
    return {"mfu": achieved / (cfg.cluster.peak_tflops * 1e12), "mem_gb": torch.cuda.max_memory_allocated() / 2**30}


def main(argv: list[str] | None = None) -> int:
    import sys

    from megatron_bridge.errors import run_cli

    code = run_cli(train, list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        sys.exit(code)
    return code
