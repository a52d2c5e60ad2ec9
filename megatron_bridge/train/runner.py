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
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bridge.backends.describe import describe
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.config.compose import compose, to_yaml
from megatron_bridge.config.schema import Config
from megatron_bridge.errors import UserError
from megatron_bridge.reliability import Watchdog, failure_message, faulty_iterator, planned
from megatron_bridge.train import lease
from megatron_bridge.train.orphans import die_with_launcher

if TYPE_CHECKING:
    from megatron_bridge.train.engines import Engine


@dataclasses.dataclass
class TrainRunConfig(Config):
    run_dir: str | None = None  # default runs/<recipe>/<timestamp>, chosen by rank 0
    export_to: str | None = None  # write an HF model here after training (LoRA: merged into the base)
    export_adapter_to: str | None = None  # peft=lora: write the adapter here in HF PEFT's format


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
        from megatron_bridge.data.indexed import check_indexed_data

        check_indexed_data(cfg.data, model_vocab_size=spec.vocab_size)
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
        if it is not None and manifest is not None:  # both or neither
            ckpt.check_meta(ckpt.iter_dir(cfg.checkpoint.dir, it), manifest, _ckpt_meta(cfg, dims, spec))
    for key, out in (("export_to", cfg.export_to), ("export_adapter_to", cfg.export_adapter_to)):
        if out and Path(out).exists() and (not Path(out).is_dir() or any(Path(out).iterdir())):
            raise UserError(f"{key}={out} exists and is not empty; choose a new directory.")
    if cfg.export_to:  # a model without HF weights cannot be exported: say so before training
        backend_of(spec).table(spec)
    _preflight_peft(cfg, spec)


def _preflight_peft(cfg, spec) -> None:
    """LoRA inputs on disk: the adapter to start from must fit the base model."""
    from megatron_bridge.bridge.lora import base_of, check_adapter_dir

    if cfg.export_adapter_to and cfg.peft.method != "lora":
        raise UserError("export_adapter_to=DIR writes a LoRA adapter, but this run trains no adapter. Add peft=lora.")
    if cfg.peft.method == "lora" and cfg.peft.init_from:
        check_adapter_dir(cfg.peft.init_from, base_of(cfg, spec), cfg.peft)


def _ckpt_meta(cfg, dims, spec) -> dict[str, Any]:
    """What a checkpoint must have been written with to be resumed (per-rank shards)."""
    meta = {"layout": dims.describe(), "engine": cfg.train.engine}
    if cfg.peft.method != "none":  # adapters only: the checkpoint refers to its base model
        from megatron_bridge.bridge.lora import base_of

        meta.update(
            peft=f"{cfg.peft.method} r={cfg.peft.rank} {sorted(cfg.peft.target_modules)}", base=base_of(cfg, spec)
        )
    return meta


def _run_dir(cfg, recipe: str) -> Path:
    import torch.distributed as dist

    obj = [cfg.run_dir or f"runs/{recipe}/{time.strftime('%Y%m%d-%H%M%S')}"]
    dist.broadcast_object_list(obj, src=0)
    return Path(obj[0])


def model_overrides(cfg) -> dict[str, Any]:
    """TransformerConfig settings of this run (precision, recompute) on top of what the
    model spec and the layout give (`runtime.tconfig.transformer_config_kwargs`)."""
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


def validate_for_launch(cfg, spec):
    """Every layout rule against the launcher's real world size (1 without a launcher), before
    torch is even imported. A world-size violation also says how many processes to start."""
    from megatron_bridge.errors import LayoutError
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.parallel.rules.registry import validate

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


@dataclasses.dataclass
class _Run:
    """What `_build` sets up for one job and the later phases share."""

    cfg: Any
    dims: Any
    recipe: str
    rank: int
    run_dir: Path
    spec: Any  # the one model description (backends.describe)
    engine: Engine
    datasets: Any


def train(argv: Sequence[str], *, finalize: bool = True) -> int:
    """Run one training job: build → resume → loop → export. `finalize=False` keeps the
    default process group alive (tests that run several layouts in one launch)."""
    die_with_launcher()  # a rank ends itself when its launcher dies (orphans.py)
    cfg, args = compose(argv, schema=TrainRunConfig)
    spec = describe(cfg.model)  # the one model description (config.json read here, once)
    dims = validate_for_launch(cfg, spec)  # every layout rule, before anything starts
    preflight(cfg, dims, spec)
    lease.acquire(cfg)  # one job per checkpoint.dir, refused before any process group (lease.py)

    run = _build(cfg, dims, args.recipe, spec)
    start = _resume(run)
    _loop(run, start)
    _export(run)
    _teardown(finalize)
    return 0


def _build(cfg, dims, recipe: str, spec) -> _Run:
    """Process groups, run directory, model (with its initial weights), engine and data."""
    import torch

    from megatron_bridge.runtime import groups
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.train.data.loader import build_datasets
    from megatron_bridge.train.engines import make_engine
    from megatron_bridge.train.init import init_weights, loads_weights

    mpu = groups.initialize(dims, timeout_minutes=cfg.train.timeout_minutes, seed=cfg.train.seed)
    rank = torch.distributed.get_rank()
    run_dir = _run_dir(cfg, recipe)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))

    overrides = model_overrides(cfg)
    chunks = build_model(spec, dims, load_weights=loads_weights(cfg, spec), **overrides)
    init_weights(chunks, spec, cfg)
    engine = make_engine(cfg, dims, chunks, mpu, bf16=overrides["bf16"])

    datasets = build_datasets(
        cfg.data,
        dims,
        seq_length=cfg.train.seq_length,
        seed=cfg.train.seed,
        train_steps=cfg.train.steps,
        model_vocab_size=spec.vocab_size,
        valid_samples=cfg.train.eval_iters * dims.global_batch_size,  # the batches every evaluation reads
    )
    return _Run(cfg, dims, recipe, rank, run_dir, spec, engine, datasets)


def _resume(run: _Run) -> int:
    """The step to start from: the latest checkpoint's when `checkpoint.resume`, else 0.
    Restores the engine's state and every RNG, so the resumed run continues bit for bit."""
    from megatron_bridge.train import checkpoint as ckpt

    cfg = run.cfg
    if not cfg.checkpoint.resume:
        return 0
    it, state = ckpt.load(cfg.checkpoint.dir, _ckpt_meta(cfg, run.dims, run.spec))
    if it is None or state is None:  # no checkpoint yet: this run starts it
        return 0
    run.engine.load_state_dict(state["engine"], Path(state["_dir"]))
    ckpt.set_rng_state(state["rng"])
    if run.rank == 0:
        print(f"resumed from {state['_dir']} (step {it})", flush=True)
    return it


def _loop(run: _Run, start: int) -> None:
    """Steps `start`+1 … (`train.steps`, or `train.exit_after` more), each logged, evaluated and
    checkpointed at its interval, under the watchdog; a failing rank names itself and the
    phase before the launcher's summary."""
    from megatron_bridge.train.metrics import MetricsLogger, gpu_metrics

    cfg, dims, rank = run.cfg, run.dims, run.rank
    logger = MetricsLogger(
        run.run_dir, cfg.train.steps, enabled=rank == 0, config={"layout": dims.describe(), "recipe": run.recipe}
    )
    tokens_per_step = dims.global_batch_size * cfg.train.seq_length
    watchdog = Watchdog(
        cfg.train.timeout_minutes * 60, rank, hint=f"train.timeout_minutes={cfg.train.timeout_minutes:g}"
    )
    phase = "training"
    try:
        stop = cfg.train.steps if cfg.train.exit_after is None else min(cfg.train.steps, start + cfg.train.exit_after)
        for step in range(start, stop):
            phase = f"step {step + 1}"
            watchdog.arm(phase)
            t0 = time.perf_counter()
            iterators = _iterators(run, run.datasets.train, step * dims.global_batch_size)
            if planned("step", step + 1):  # test-only fault injection (MBR_FAULT), see reliability.py
                iterators = _with_fault(iterators, step + 1, dims.grad_accum)
            loss, grad_norm, lr = run.engine.step(iterators)
            dt = time.perf_counter() - t0
            metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": dt}
            metrics.update(tokens_per_s=tokens_per_step / dt, **gpu_metrics(cfg, dims, dt, run.spec))
            if _eval_due(cfg, step + 1, last=step + 1 == stop):
                phase = f"evaluation at step {step + 1}"
                watchdog.arm(phase)
                metrics["val_loss"] = _evaluate(run)
            if (step + 1) % cfg.train.log_interval == 0 or step + 1 == cfg.train.steps or "val_loss" in metrics:
                logger.log(step + 1, metrics)
            if _save_due(cfg, step + 1, last=step + 1 == stop):
                phase = f"checkpoint save at step {step + 1}"
                watchdog.arm(phase)
                _save(run, step + 1)
    except Exception as e:  # name the rank and the step before the launcher's summary
        if not isinstance(e, UserError):
            print(failure_message(rank, phase, e), file=sys.stderr, flush=True)
        raise
    finally:
        watchdog.close()
        logger.close()


def _iterators(run: _Run, dataset, consumed: int):
    """`make_iterators` over `dataset` from global sample `consumed`: fresh iterators on this
    rank's dp/cp share. A step starts at step·global batch (so a resume reads on), an
    evaluation at 0 of the valid split."""
    from megatron.core import parallel_state as ps

    from megatron_bridge.train.data.loader import make_iterator

    dp_rank, cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
    return lambda n: [
        make_iterator(dataset, run.dims, dp_rank=dp_rank, cp_rank=cp_rank, consumed_samples=consumed) for _ in range(n)
    ]


def _eval_due(cfg, step: int, *, last: bool) -> bool:
    """Every `train.eval_interval` steps and at the last step of this launch, when
    `train.eval_iters` > 0 (eval_interval=0: at the end only — megatron-LM's convention)."""
    t = cfg.train
    return t.eval_iters > 0 and (bool(t.eval_interval and step % t.eval_interval == 0) or last)


def _evaluate(run: _Run) -> float:
    """`val_loss`: the first `train.eval_iters` global batches of the valid split, the same ones
    at every evaluation. Every generator is put back afterwards (the engines already run eval
    mode, which draws nothing), so a run with evaluation trains exactly like one without."""
    from megatron_bridge.train import checkpoint as ckpt

    rng = ckpt.rng_state()
    try:
        return run.engine.evaluate(_iterators(run, run.datasets.valid, 0), run.cfg.train.eval_iters)
    finally:
        ckpt.set_rng_state(rng)


def _save_due(cfg, step: int, *, last: bool) -> bool:
    """Every `checkpoint.save_interval` steps and at the last step of this launch."""
    every = cfg.checkpoint.save_interval
    return bool(cfg.checkpoint.dir) and (bool(every and step % every == 0) or last)


def _save(run: _Run, step: int) -> None:
    from megatron_bridge.train import checkpoint as ckpt

    state = {"engine": run.engine.state_dict(), "rng": ckpt.rng_state(), "step": step}

    def extra(directory: Path) -> None:  # engine files; a LoRA run's adapter in HF PEFT format too
        run.engine.write_extra(directory)
        if run.cfg.peft.method == "lora":
            from megatron_bridge.bridge.lora import ADAPTER_DIR, base_of
            from megatron_bridge.runtime.lora_modules import export_adapter

            export_adapter(
                run.engine.model_chunks, run.cfg.peft, str(directory / ADAPTER_DIR), base_of(run.cfg, run.spec)
            )

    ckpt.save(run.cfg.checkpoint.dir, step, state, _ckpt_meta(run.cfg, run.dims, run.spec), extra=extra)


def _export(run: _Run) -> None:
    """The trained weights as a Hugging Face model, when `export_to` is set (LoRA adapters
    merged in), and the adapter alone in HF PEFT's format when `export_adapter_to` is."""
    cfg = run.cfg
    from megatron_bridge.runtime.lora_modules import export_adapter, merged

    chunks = run.engine.model_chunks
    if cfg.export_adapter_to:
        from megatron_bridge.bridge.lora import base_of

        export_adapter(chunks, cfg.peft, cfg.export_adapter_to, base_of(cfg, run.spec))
        if run.rank == 0:
            print(f"exported the LoRA adapter (HF PEFT format) to {cfg.export_adapter_to}", flush=True)
    if not cfg.export_to:
        return
    from megatron_bridge.bridge.loader import export_hf_weights

    with merged(chunks):  # a no-op without adapters
        export_hf_weights(chunks, run.spec, cfg.export_to, source_dir=run.spec.source)
    if run.rank == 0:
        print(f"exported Hugging Face model to {cfg.export_to}", flush=True)


def _teardown(finalize: bool) -> None:
    """All groups down, or (`finalize=False`) megatron's only, for the next job in this process."""
    if finalize:
        from megatron_bridge.runtime import groups

        groups.destroy()
    else:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()


def _with_fault(make, step: int, micro_batches: int):
    """`make_iterators` whose first iterator fires the MBR_FAULT `step` fault mid-step."""

    def wrapped(n: int):
        its = make(n)
        its[0] = faulty_iterator(its[0], step, min(1, max(micro_batches - 1, 0)))
        return its

    return wrapped


def main(argv: list[str] | None = None) -> int:
    import sys

    from megatron_bridge.errors import run_cli

    code = run_cli(train, list(sys.argv[1:] if argv is None else argv))
    if argv is None:
        sys.exit(code)
    return code
