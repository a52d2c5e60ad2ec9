"""Preemption signals and non-finite steps in a single-process run (no launcher), both engines:
one interpreter runs every job in sequence (tests/reliability/scripts/jobs.py; the torchrun
case is in test_crash_resume.py's chain).

  * SIGTERM (megatron engine) and SIGUSR1 (DeepSpeed) arriving mid-step: the job finishes the
    step, saves it, prints one line, exits 0; `checkpoint.resume=true` continues bit for bit;
  * `train.on_nonfinite=skip`: a NaN step is dropped and counted, training goes on (and the
    DeepSpeed ZeRO-0 path, where DeepSpeed itself checks nothing, skips like megatron's);
    `train.max_skipped_steps` in a row end the job (exit 3);
  * `train.on_nonfinite=stop` (the default) ends the job at the NaN step with exit 3, naming it,
    and publishes nothing of it: `latest` stays on the last good checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from megatron_bridge.train import manifest

try:  # pytest's default (prepend) import mode puts this directory on sys.path
    from harness import ROOT, SCRIPT, job_env
except ImportError:  # pragma: no cover
    from tests.reliability.harness import ROOT, SCRIPT, job_env

STEPS = 6
COMMON = [
    "recipe=default",
    "parallel.dp=1",
    f"train.steps={STEPS}",
    "train.seq_length=32",
    "train.global_batch_size=2",
    "optimizer.warmup_steps=1",
    "optimizer.lr=3e-3",
    "data=synthetic",
    "checkpoint.save_interval=2",
]
DS = ["train.engine=deepspeed", "zero.stage=0", "train.on_nonfinite=skip"]
NAN2 = "nan:step:0:2"


def _job(name: str, fault: str, *overrides: str, code: int = 0) -> str:
    return f"{name}|{fault}|" + ",".join([*COMMON, *overrides]) + (f"|{code}" if code else "")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("signals")
    ck = {n: f"checkpoint.dir={root / n}" for n in ("term", "ds", "maxskip", "stop")}
    jobs = [
        _job("ref", ""),
        _job("term", "term:step:0:3", ck["term"]),
        _job("term_resume", "", ck["term"], "checkpoint.resume=true"),
        _job("ds_ref", NAN2, *DS),  # step 2 skipped
        _job("ds_usr1", f"{NAN2},usr1:step:0:4", *DS, ck["ds"]),
        _job("ds_resume", "", *DS, ck["ds"], "checkpoint.resume=true"),
        _job(
            "maxskip",
            f"{NAN2},nan:step:0:3",
            "train.on_nonfinite=skip",
            "train.max_skipped_steps=2",
            ck["maxskip"],
            code=3,
        ),
        _job("stop", "nan:step:0:5", ck["stop"], code=3),
    ]
    out = root / "out"
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, SCRIPT, str(out), *jobs],
        cwd=ROOT,
        env=job_env(out / "faults"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    wall = time.monotonic() - t0
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    print("\n".join(line for line in log.splitlines() if line.startswith(("job ", "startup"))), f"wall {wall:.1f} s")
    results = json.loads((out / "results.json").read_text())
    return root, results, log, wall


def test_sigterm_saves_the_step_and_resume_is_exact(run):
    root, r, log, _ = run
    assert "SIGTERM: stopping after step 3: saved checkpoint" in log, log[-3000:]
    assert f"resumed from {root / 'term'}/iter_0000003 (step 3)" in log  # the signal's checkpoint, then resumed
    assert r["term"] == {k: r["ref"][k] for k in ("1", "2", "3")}  # the step under way was finished
    assert r["term_resume"] == {k: r["ref"][k] for k in ("4", "5", "6")}  # bit for bit


def test_sigusr1_under_deepspeed_and_a_skipped_step(run):
    root, r, log, _ = run
    assert "SIGUSR1: stopping after step 4: saved checkpoint" in log, log[-3000:]
    assert (
        "step 2 has a non-finite loss or gradient norm (loss nan, grad norm nan): skipped (1 in a row, 1 in all)" in log
    )
    ref = r["ds_ref"]
    assert ref["2"] != ref["2"] and all(ref[k] == ref[k] for k in ("1", "3", "4", "5", "6"))  # NaN, then finite
    assert f"resumed from {root / 'ds'}/iter_0000004 (step 4)" in log
    assert r["ds_resume"] == {k: ref[k] for k in ("5", "6")}


def test_max_skipped_steps_in_a_row_end_the_job(run):
    root, r, log, _ = run
    assert r["maxskip"] == {"exit": 3}
    assert "step 3 has a non-finite loss or gradient norm" in log and "2 non-finite steps in a row" in log
    assert manifest.latest_iteration(root / "maxskip") == 2  # step 2 dropped: its checkpoint holds step 1's weights


def test_stop_names_the_step_and_publishes_nothing_of_it(run):
    root, r, log, _ = run
    assert r["stop"] == {"exit": 3}
    assert "error: step 5 has a non-finite loss or gradient norm" in log
    assert manifest.latest_iteration(root / "stop") == 4
    assert not list((root / "stop").glob("iter_0000005*"))
