"""One training job, once runner.py has composed, validated and preflighted its config:
process groups, run directory, model (with its initial weights), engine and data; resume,
the training loop (logged, evaluated, checkpointed, under the watchdog), export; teardown.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.bridge.lora import ADAPTER_DIR, base_of
from megatron_bridge.config.compose import to_yaml
from megatron_bridge.errors import UserError
from megatron_bridge.reliability import Watchdog, faulty_iterator, planned
from megatron_bridge.runtime import fast_paths, groups
from megatron_bridge.runtime.build import build_model
from megatron_bridge.runtime.compiled import report as compile_report
from megatron_bridge.runtime.hf_export import HFExport
from megatron_bridge.runtime.lora_modules import export_adapter, merged
from megatron_bridge.runtime.runtimes import runtime_of
from megatron_bridge.runtime.weights import export_hf_weights, start_hf_export
from megatron_bridge.train import checkpoint as ckpt
from megatron_bridge.train.data.loader import build_datasets, make_iterator
from megatron_bridge.train.engines import Engine, make_engine
from megatron_bridge.train.guard import NonFinite, NonFiniteSteps, StopSignals, check_finite_weights
from megatron_bridge.train.host_staging import HostStaging
from megatron_bridge.train.inflight import InFlight
from megatron_bridge.train.init import init_weights, loads_weights
from megatron_bridge.train.metrics import MetricsLogger, gpu_metrics
from megatron_bridge.train.objectives import make_objective
from megatron_bridge.train.restarts import Attempt, run_dir_of
from megatron_bridge.train.stragglers import Stragglers


def model_overrides(cfg) -> dict[str, Any]:
    """TransformerConfig settings of this run (precision, recompute) on top of what the
    model spec and the layout give (`runtime.tconfig.transformer_config_kwargs`)."""
    t = cfg.train
    bf16 = t.precision == "bf16" or (t.precision in ("auto", "fp8") and torch.cuda.is_available())
    out: dict[str, Any] = {"bf16": bf16}
    if bf16:
        out["params_dtype"] = torch.bfloat16
    if t.fused:  # megatron-core's fused kernels (what runtime/tconfig.py keeps of them: fusable_activation)
        out.update(bias_activation_fusion=True, bias_dropout_fusion=True)
        if bf16:  # its fused cross entropy hands back a bf16 logits gradient: the same values only in bf16
            out.update(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")
    if t.recompute == "selective":
        out.update(recompute_granularity="selective", recompute_modules=list(t.recompute_modules))
    elif t.recompute == "full":
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return out


@dataclasses.dataclass
class _Run:
    """What `_build` sets up for one job and the later phases share."""

    cfg: Any
    dims: Any
    recipe: str
    meta: dict[str, Any]  # what its checkpoints are written with and must be resumed with
    rank: int
    run_dir: Path
    spec: Any  # the one model description (backends.describe)
    engine: Engine
    datasets: Any
    compiled: int = 0  # train.compile: the transformer layers compiled on this rank


def run(cfg, dims, spec, recipe: str, meta: dict[str, Any], *, finalize: bool = True) -> None:
    """The job of a composed, validated and preflighted config (runner.train): build → resume
    → loop → export. `meta` is what its checkpoints carry (`runner.ckpt_meta`); `finalize=False`
    keeps the default process group alive (tests that run several layouts in one launch)."""
    job = _build(cfg, dims, spec, recipe, meta)
    start = _resume(job)
    try:
        _sweep_partial_exports(job)
        if _loop(job, start):  # False: stopped early (a signal, train.exit_after), saved, nothing exported
            _export(job)
    except NonFinite:  # every rank raises it at the same step: the groups can be taken down
        _teardown(finalize)
        raise
    _teardown(finalize)


def _run_dir(cfg, recipe: str) -> Path:
    obj = [run_dir_of(cfg) or f"runs/{recipe}/{time.strftime('%Y%m%d-%H%M%S')}"]
    torch.distributed.broadcast_object_list(obj, src=0)
    return Path(obj[0])


def _build(cfg, dims, spec, recipe: str, meta: dict[str, Any]) -> _Run:
    """Process groups, run directory, model (with its initial weights), engine and data."""
    mpu = groups.initialize(dims, timeout_minutes=cfg.train.timeout_minutes, seed=cfg.train.seed)
    rank = torch.distributed.get_rank()
    run_dir = _run_dir(cfg, recipe)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))

    overrides = model_overrides(cfg)
    chunks = build_model(spec, dims, load_weights=loads_weights(cfg, spec), **overrides)
    init_weights(chunks, spec, cfg)
    compiled = fast_paths.set_up(chunks, runtime_of(spec), cfg.train, rank)
    datasets = build_datasets(
        cfg.data,
        dims,
        seq_length=cfg.train.seq_length,
        seed=cfg.train.seed,
        train_steps=cfg.train.steps,
        model_vocab_size=spec.vocab_size,
        valid_samples=cfg.train.eval_iters * dims.global_batch_size,  # the batches every evaluation reads
    )
    objective = make_objective(cfg, dims, spec, chunks, overrides, datasets)  # a frozen model: after the policy
    engine = make_engine(
        cfg, dims, chunks, mpu, bf16=overrides["bf16"], global_names=runtime_of(spec).global_names, objective=objective
    )
    return _Run(cfg, dims, recipe, meta, rank, run_dir, spec, engine, datasets, compiled)


def _resume(run: _Run) -> int:
    """The step to start from: the latest checkpoint's when `checkpoint.resume`, else 0.
    Restores the engine's state and every RNG, so the resumed run continues bit for bit."""
    cfg = run.cfg
    if not cfg.checkpoint.resume:
        return 0
    it, state = ckpt.load(cfg.checkpoint.dir, run.meta)
    if it is None or state is None:  # no checkpoint yet: this run starts it
        return 0
    run.engine.load_state_dict(state["engine"], Path(state["_dir"]))
    ckpt.set_rng_state(state["rng"])
    if run.rank == 0:
        print(f"resumed from {state['_dir']} (step {it})", flush=True)
    return it


def _loop(run: _Run, start: int) -> bool:
    """Steps `start`+1 … (`train.steps`, or `train.exit_after` more), each logged, evaluated and
    checkpointed at its interval, under the watchdog; a failing rank names itself and the
    phase before the launcher's summary. A non-finite step is skipped or ends the job
    (`train.on_nonfinite`, guard.py); SIGTERM/SIGUSR1 save at the next step boundary and end
    the loop early, and `train.exit_after` ends it before `train.steps`: False then (True when
    training reached `train.steps`: the end-of-run export is the trained model's, and a stopped
    run resumes into the same `export_to`)."""
    cfg, dims, rank = run.cfg, run.dims, run.rank
    logger = MetricsLogger(
        run.run_dir,
        cfg.train.steps,
        enabled=rank == 0,
        loggers=cfg.logger,
        config={"layout": dims.describe(), "recipe": run.recipe},
    )
    tokens_per_step = dims.global_batch_size * cfg.train.seq_length
    attempt = Attempt(cfg, rank, torch.distributed.get_world_size(), run.run_dir, start)  # restarts.py
    watchdog = Watchdog(
        cfg.train.timeout_minutes * 60,
        rank,
        hint=f"train.timeout_minutes={cfg.train.timeout_minutes:g}",
        **attempt.watchdog_args(),
    )
    phase, step = "training", start
    nonfinite, signals = (
        NonFiniteSteps(cfg),
        StopSignals(run.engine.device, save_on_launcher_gone=bool(cfg.checkpoint.dir)),
    )
    stragglers = Stragglers(
        run.engine.phases,
        cfg.train.straggler_interval,
        cfg.train.straggler_factor,
        rank=rank,
        stage=ps.get_pipeline_model_parallel_rank(),
    )
    saves: InFlight[ckpt.Pending] = InFlight(lambda p: p.finish())  # checkpoint.async_save
    staging = HostStaging() if cfg.checkpoint.async_save else None  # its host buffers, reused per save
    exports: InFlight[HFExport] = InFlight(lambda e: _published(run, e))  # train.export_interval
    try:
        stop = cfg.train.steps if cfg.train.exit_after is None else min(cfg.train.steps, start + cfg.train.exit_after)
        for step in range(start, stop):
            phase = f"step {step + 1}"
            watchdog.arm(phase)
            attempt.step_started()
            t0 = time.perf_counter()
            iterators = _iterators(run, run.datasets.train, step * dims.global_batch_size)
            if planned("step", step + 1):  # test-only fault injection (MBR_FAULT), see reliability.py
                iterators = _with_fault(iterators, step + 1, dims.grad_accum)
            run.engine.phases.start()
            result = run.engine.step(iterators)
            run.engine.phases.stop()
            loss, grad_norm, lr = result.loss, result.grad_norm, result.lr
            nonfinite.after(step + 1, loss, grad_norm, result.applied, rank)  # raises when the step ends the job
            attempt.step_done(step + 1)
            if run.compiled and step == start and rank == 0:
                print(compile_report(run.compiled), flush=True)
            dt = time.perf_counter() - t0
            metrics = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_time": dt, **result.metrics}
            metrics.update(tokens_per_s=tokens_per_step / dt, **gpu_metrics(cfg, dims, dt, run.spec))
            metrics.update(stragglers.after(step + 1))  # collective every train.straggler_interval steps
            if _eval_due(cfg, step + 1, last=step + 1 == stop):
                phase = f"evaluation at step {step + 1}"
                watchdog.arm(phase)
                metrics["val_loss"] = _evaluate(run)
            if (
                (step + 1) % cfg.train.log_interval == 0
                or step + 1 == cfg.train.steps
                or metrics.keys() & {"val_loss", "slowest_rank"}
            ):
                metrics.update(_stalls(save=saves, export=exports), **attempt.metrics())
                logger.log(step + 1, metrics)
            saves.poll()
            exports.poll()
            stop_signal = signals.requested()  # collective: every rank stops after the same step
            ending = step + 1 == stop or bool(stop_signal)
            if _save_due(cfg, step + 1, last=step + 1 == stop) or (stop_signal and cfg.checkpoint.dir):
                phase = f"checkpoint save at step {step + 1}"
                watchdog.arm(phase)
                saves.start(partial(_save, run, step + 1, staging))
                attempt.saved(step + 1)
                if not cfg.checkpoint.async_save or ending:
                    saves.drain()  # the last one is published before the job ends
            if cfg.train.export_interval and (step + 1) % cfg.train.export_interval == 0:
                phase = f"HF export at step {step + 1}"
                watchdog.arm(phase)
                exports.start(partial(_export_snapshot, run, step + 1))
            if ending:
                phase = f"HF export at step {step + 1}"
                watchdog.arm(phase)
                exports.drain()  # the job ends with every export published
            if stop_signal:
                if rank == 0:
                    saved = (
                        f"saved checkpoint {cfg.checkpoint.dir} at step {step + 1}; resume with checkpoint.resume=true"
                    )
                    print(
                        f"{stop_signal}: stopping after step {step + 1}: "
                        f"{saved if cfg.checkpoint.dir else 'no checkpoint.dir, nothing saved'}",
                        flush=True,
                    )
                attempt.end("stopped")
                return False
        attempt.end("finished" if stop == cfg.train.steps else "stopped")
        return stop == cfg.train.steps
    except Exception as e:  # name the rank and the step before the launcher's summary
        if not isinstance(e, UserError):
            print(attempt.failed(phase, step + 1, e), file=sys.stderr, flush=True)
        raise
    finally:
        attempt.close()
        signals.close()
        watchdog.close()
        logger.close()


def _stalls(**inflight: InFlight) -> dict[str, float]:
    """The training thread's seconds in checkpoint saves / HF exports since the previous logged
    line (`save_s`/`export_s`: snapshot and start; `save_wait_s`/`export_wait_s`: waiting for
    the previous write and publishing it), for the kinds that did any."""
    out: dict[str, float] = {}
    for name, pending in inflight.items():
        snapshot, wait = pending.take_seconds()
        if snapshot or wait > 1e-3:
            out.update({f"{name}_s": snapshot, f"{name}_wait_s": wait})
    return out


def _iterators(run: _Run, dataset, consumed: int):
    """`make_iterators` over `dataset` from global sample `consumed`: fresh iterators on this
    rank's dp/cp share. A step starts at step·global batch (so a resume reads on), an
    evaluation at 0 of the valid split."""
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
    rng = ckpt.rng_state()
    try:
        return run.engine.evaluate(_iterators(run, run.datasets.valid, 0), run.cfg.train.eval_iters)
    finally:
        ckpt.set_rng_state(rng)


def _save_due(cfg, step: int, *, last: bool) -> bool:
    """Every `checkpoint.save_interval` steps and at the last step of this launch."""
    every = cfg.checkpoint.save_interval
    return bool(cfg.checkpoint.dir) and (bool(every and step % every == 0) or last)


def _save(run: _Run, step: int, staging: HostStaging | None = None) -> ckpt.Pending:
    """Snapshot and write this step's checkpoint; published by the returned `Pending.finish`
    (the rank files written in the background with `checkpoint.async_save`, from a host copy
    in `staging`'s buffers)."""
    check_finite_weights(run.engine.model_chunks, step, run.engine.device)  # collective; raises NonFinite
    state = {"engine": run.engine.state_dict(), "rng": ckpt.rng_state(), "step": step}

    def extra(directory: Path) -> None:  # engine files; a LoRA run's adapter in HF PEFT format too
        run.engine.write_extra(directory)
        if run.cfg.peft.method == "lora":
            export_adapter(
                run.engine.model_chunks, run.cfg.peft, str(directory / ADAPTER_DIR), base_of(run.cfg, run.spec)
            )

    return ckpt.start(
        run.cfg.checkpoint.dir, step, state, run.meta, extra, background=run.cfg.checkpoint.async_save, staging=staging
    )


def _export(run: _Run) -> None:
    """The trained weights as a Hugging Face model, when `export_to` is set (LoRA adapters
    merged in), and the adapter alone in HF PEFT's format when `export_adapter_to` is."""
    cfg = run.cfg
    chunks = run.engine.model_chunks
    if cfg.export_adapter_to:
        export_adapter(chunks, cfg.peft, cfg.export_adapter_to, base_of(cfg, run.spec))
        if run.rank == 0:
            print(f"exported the LoRA adapter (HF PEFT format) to {cfg.export_adapter_to}", flush=True)
    if not cfg.export_to:
        return
    _export_hf(run, Path(cfg.export_to))
    if run.rank == 0:
        print(f"exported Hugging Face model to {cfg.export_to}", flush=True)


def _export_hf(run: _Run, out: Path) -> None:
    """Collective: the model as an HF directory in `out`, LoRA adapters merged in."""
    with merged(run.engine.model_chunks):  # a no-op without adapters
        export_hf_weights(run.engine.model_chunks, run.spec, out, source_dir=run.spec.source)


def _sweep_partial_exports(run: _Run) -> None:
    """Rank 0, before the first interval export: `iter_NNNNNNN.tmp/` left by a run that stopped
    while writing one (never published; the preflight let only interval exports through)."""
    if run.rank == 0 and run.cfg.train.export_interval and run.cfg.export_to and Path(run.cfg.export_to).is_dir():
        for tmp in Path(run.cfg.export_to).glob("iter_*.tmp"):
            shutil.rmtree(tmp)


def _export_snapshot(run: _Run, step: int) -> HFExport:
    """`train.export_interval`: the model as an HF directory, `export_to/iter_NNNNNNN/`, written
    into `iter_NNNNNNN.tmp/` and published by rename (a reader never sees a partial one) when
    the loop calls `_published`. The step pays the gathers and host copies; a writer thread
    writes behind the loop (`train.export_buffer_bytes`, runtime/hf_export.py)."""
    final = Path(run.cfg.export_to) / f"iter_{step:07d}"
    with merged(run.engine.model_chunks):  # a no-op without adapters; the queued copies are merged
        return start_hf_export(
            run.engine.model_chunks,
            run.spec,
            final.with_name(final.name + ".tmp"),
            source_dir=run.spec.source,
            buffer_bytes=run.cfg.train.export_buffer_bytes,
            publish_as=final,
        )


def _published(run: _Run, export: HFExport) -> None:
    """Collective: wait for the export's writers, then rename it into place."""
    final = export.finish()
    if run.rank == 0:
        print(f"exported Hugging Face model to {final}", flush=True)


def _teardown(finalize: bool) -> None:
    """All groups down, or (`finalize=False`) megatron's only, for the next job in this process."""
    if finalize:
        groups.destroy()
    else:
        groups.release()


def _with_fault(make, step: int, micro_batches: int):
    """`make_iterators` whose first iterator fires the MBR_FAULT `step` fault mid-step."""

    def wrapped(n: int):
        its = make(n)
        its[0] = faulty_iterator(its[0], step, min(1, max(micro_batches - 1, 0)))
        return its

    return wrapped
