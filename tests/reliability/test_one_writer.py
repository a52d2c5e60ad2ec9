"""One job per checkpoint directory, and ranks that die with the `deepspeed` launcher.

* Two concurrent jobs on one checkpoint directory: job A (torchrun ×2) is held mid-step 4 by an
  injected `pause` (after its step-2 checkpoint); job B (torchrun ×2, same checkpoint.dir) is
  refused before any process group exists: every rank of B that gets to its check exits 2 by
  itself naming A's rank 0 (host, pid) and the fix (torchrun SIGTERMs a rank still starting up
  once the first has refused); no run directory is made. A then finishes, its checkpoints
  verify (`mbr check-ckpt`) and its lease is gone.
* SIGTERM to the `deepspeed` runner alone (`kill RUNNER`; it dies of it without forwarding,
  as of SIGKILL) while its ranks are held mid-step 3: it is two processes (runner -> launch.py
  -> ranks), so the ranks' own parent survives; they notice the runner's death, finish the
  step, save it (`launcher gone: stopping after step 3`), exit 0, and launch.py exits after
  them. A rank that cannot reach its step boundary then (hung) still ends within
  orphans.STOP_S: tests/unit/train/test_orphans.py with stand-in launchers.

* SIGTERM to every process of a `deepspeed` launch (what Slurm does at preemption): the runner
  dies of it without forwarding, launch.py SIGTERMs the ranks and waits; the ranks, held
  mid-step 3, finish the step, save it, print one line and exit 0 — the dead runner does not
  end them first (orphans.defer) — and the checkpoint of step 3 is published and verifies.

The lease taken over from a killed job and the torchrun agent SIGKILLed alone are scenarios of
test_crash_resume.py (they need its references to check the resume).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bridge.train import manifest
from megatron_bridge.train.lease import LEASE

try:  # pytest's default (prepend) import mode puts this directory on sys.path
    from harness import ROOT, _kill_tree, children, job_env, spawn, torchrun, torchrun_failures, wait_gone
except ImportError:  # pragma: no cover
    from tests.reliability.harness import (
        ROOT,
        _kill_tree,
        children,
        job_env,
        spawn,
        torchrun,
        torchrun_failures,
        wait_gone,
    )

pytestmark = pytest.mark.dist

NEEDS_DEEPSPEED = pytest.mark.skipif(
    shutil.which("deepspeed", path=str(Path(sys.executable).parent)) is None, reason="no deepspeed"
)
COMMON = [
    "recipe=default",
    "train.seq_length=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "optimizer.warmup_steps=2",
    "data=synthetic",
    "checkpoint.save_interval=2",
]


def _wait(pred, proc: subprocess.Popen, log: Path, limit: float = 240) -> None:
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None or time.monotonic() - t0 > limit:
            _kill_tree(proc)
            raise AssertionError(f"job ended or stalled before the test could act\n{log.read_text()[-6000:]}")
        time.sleep(0.1)


def _deepspeed_job(ck: Path, run: Path) -> list[str]:
    """The `deepspeed` launcher training 2 ranks for 6 steps, checkpointing every 2."""
    from megatron_bridge.testing import free_port

    return [
        str(Path(sys.executable).parent / "deepspeed"),
        *("--num_gpus", "2", "--master_port", str(free_port()), "--module", "megatron_bridge.train"),
        *COMMON,
        "cluster.gpus_per_node=2",
        "train.steps=6",
        f"checkpoint.dir={ck}",
        f"run_dir={run}",
    ]


def _faults(d: Path) -> int:
    return len(list(d.iterdir())) if d.exists() else 0


def test_second_job_on_a_held_directory_is_refused(tmp_path):
    from megatron_bridge.cli import main as mbr

    ck, faults = tmp_path / "ck", tmp_path / "faults"
    log_a = tmp_path / "a.log"
    a = spawn(
        torchrun(
            2,
            "-m",
            "megatron_bridge.train",
            *COMMON,
            "train.steps=6",
            f"checkpoint.dir={ck}",
            f"run_dir={tmp_path / 'a'}",
        ),
        job_env(faults, "pause:step:*:4"),
        log_a,
    )
    try:
        _wait(lambda: _faults(faults) == 2, a, log_a)  # A holds the lease, sits in step 4
        holder = json.loads((ck / LEASE).read_text())
        assert manifest.latest_iteration(ck) == 2
        t0 = time.monotonic()
        b = subprocess.run(
            torchrun(
                2,
                "-m",
                "megatron_bridge.train",
                *COMMON,
                "train.steps=6",
                f"checkpoint.dir={ck}",
                f"run_dir={tmp_path / 'b'}",
            ),
            cwd=ROOT,
            env=job_env(tmp_path / "faults_b"),
            capture_output=True,
            text=True,
            timeout=240,
        )
        out = b.stdout + b.stderr
        print(f"second job refused: torchrun exited {b.returncode} after {time.monotonic() - t0:.1f} s")
        assert b.returncode != 0, out[-4000:]
        # The first rank to check exits 2; torchrun stops the other (SIGTERM) if it has not refused yet.
        codes = torchrun_failures(out)
        assert 2 in codes.values() and set(codes.values()) <= {2, -15}, out[-4000:]
        msg = f"checkpoint.dir={ck} is in use by another training job (host {holder['host']}, pid {holder['pid']}"
        # every rank that exited 2 printed the paragraph once; a rank SIGTERMed by torchrun may
        # have printed it too just before the signal (a race, not a fault), none prints it twice
        refused = list(codes.values()).count(2)
        assert refused <= out.count(msg) <= len(codes), out[-4000:]
        assert "give this job its own checkpoint.dir=NEW_DIR" in out
        assert not (tmp_path / "b").exists()  # no run directory: nothing started
        (faults / "continue").write_text("")
        assert a.wait(timeout=240) == 0, log_a.read_text()[-6000:]
    finally:
        if a.poll() is None:
            _kill_tree(a)
    assert manifest.latest_iteration(ck) == 6
    assert mbr(["check-ckpt", str(ck)]) == 0  # every manifest of A verifies
    assert not (ck / LEASE).exists()  # released at A's clean exit
    steps = [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 7))


def _held_at_step_3(tmp_path: Path) -> tuple[subprocess.Popen, Path, Path, Path]:
    """A `deepspeed` launch (runner, ck, log, faults) whose 2 ranks are both held mid-step 3."""
    faults, log, ck = tmp_path / "faults", tmp_path / "ds.log", tmp_path / "ck"
    runner = spawn(_deepspeed_job(ck, tmp_path / "run"), job_env(faults, "pause:step:*:3"), log)
    _wait(lambda: _faults(faults) == 2, runner, log)
    return runner, ck, log, faults


def _step_3_saved(out: str, ck: Path, line: str) -> None:
    """Rank 0 printed `line` once, no rank ended as an orphan, and step 3 is published intact."""
    assert out.count(line) == 1, out[-4000:]
    assert "exiting so no orphaned rank keeps training" not in out, out[-4000:]
    assert manifest.latest_iteration(ck) == 3
    manifest.verify(manifest.iter_dir(ck, 3))


@NEEDS_DEEPSPEED
def test_sigterm_to_a_deepspeed_launch_saves_the_step(tmp_path):
    runner, ck, log, faults = _held_at_step_3(tmp_path)
    try:
        ranks = [r for p in children(runner.pid) for r in children(p)]
        os.killpg(runner.pid, signal.SIGTERM)  # runner, launch.py and both ranks, as Slurm signals a step
        time.sleep(1.0)  # the ranks note the signal while held
        (faults / "continue").touch()
        gone = wait_gone(ranks, 120)
    finally:
        _kill_tree(runner)
    out = log.read_text()
    assert gone is not None, out[-4000:]
    _step_3_saved(out, ck, "SIGTERM: stopping after step 3: saved checkpoint")


@NEEDS_DEEPSPEED
def test_sigterm_to_the_deepspeed_runner_alone_saves_the_step(tmp_path):
    runner, ck, log, faults = _held_at_step_3(tmp_path)
    try:
        launch_py = children(runner.pid)
        ranks = [r for p in launch_py for r in children(p)]
        os.kill(runner.pid, signal.SIGTERM)  # the runner only: it dies without forwarding
        assert runner.wait(timeout=30) == -signal.SIGTERM
        t0 = time.monotonic()  # both ranks note the runner's death (their watch ticks twice a second)
        while log.read_text().count("while this rank's own launcher lives on") < 2:
            assert time.monotonic() - t0 < 30, log.read_text()[-4000:]
            time.sleep(0.1)
        (faults / "continue").touch()
        gone = wait_gone(ranks, 120)
        launcher_gone = wait_gone(launch_py, 30)
    finally:
        _kill_tree(runner)
        for pid in [*locals().get("ranks", []), *locals().get("launch_py", [])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    out = log.read_text()
    assert gone is not None and launcher_gone is not None, out[-4000:]
    _step_3_saved(out, ck, "launcher gone: stopping after step 3: saved checkpoint")
