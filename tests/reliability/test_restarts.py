"""A job that restarts itself: one `mbr launch max_restarts=2` (it execs torchrun with
`--max-restarts=2` and c10d rendezvous, and adds `checkpoint.resume=auto`), 2 ranks,
checkpoints every 3 of 14 steps. Rank 1 is SIGKILLed in step 5 of
the first attempt; in the restarted attempt rank 0 is frozen (SIGSTOP) in step 9 and rank 1's
watchdog ends the attempt, naming rank 0 as silent. The job must exit 0 having run all 14
steps, every logged step's loss (including the recomputed ones) equal bit for bit to an
uninterrupted run's, each fault's record (and the watchdog's stacks) in the run directory, and
the ledger's goodput summary printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge.testing import free_port
from megatron_bridge.train import attempts

pytestmark = pytest.mark.dist

ARGS = [
    "recipe=default",
    "train.steps=14",
    "train.seq_length=32",
    "train.global_batch_size=4",
    "data=synthetic",
    "checkpoint.save_interval=3",
    "train.log_interval=1",
    "train.timeout_minutes=0.15",
]


def _launch(tmp: Path, name: str, fault: str, restarts: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MBR_FAULT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["MBR_FAULT"] = fault
    cmd = [
        sys.executable,
        "-m",
        "megatron_bridge.cli",
        "launch",
        "cluster.gpus_per_node=2",
        f"cluster.master_port={free_port()}",
        f"max_restarts={restarts}",
        *ARGS,
        f"checkpoint.dir={tmp / name / 'ck'}",
        f"run_dir={tmp / name / 'run'}",
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def _losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_restarts_after_a_kill_and_a_freeze(tmp_path):
    ref = _launch(tmp_path, "ref", "", 0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = dict(_losses(tmp_path / "ref" / "run"))
    assert sorted(want) == list(range(1, 15))

    p = _launch(tmp_path, "chaos", "kill:step:1:5:0,stop:step:0:9:1", 2)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "injecting kill:step:1:5:0" in out and "injecting stop:step:0:9:1" in out
    run = tmp_path / "chaos" / "run"
    got = _losses(run)
    assert {s for s, _ in got} == set(range(1, 15))
    for step, loss in got:  # recomputed steps too
        assert loss == want[step], (step, loss, want[step])
    assert "restart 1 of --max-restarts=2: resuming from step 3" in out
    assert "restart 2 of --max-restarts=2: resuming from step 6" in out
    first = (run / "faults" / "attempt_0" / "rank_0.txt").read_text()
    assert "rank 0 failed in step 5" in first
    frozen = (run / "faults" / "attempt_1" / "rank_1.txt").read_text()
    assert "silent ranks (frozen, or their host is gone): rank 0" in frozen
    assert "Python stacks of every thread" in frozen and "_coalescing_manager" in frozen
    led = attempts.read(tmp_path / "chaos" / "ck")["attempts"]
    assert [a["attempt"] for a in led] == [0, 1, 2] and led[-1]["outcome"] == "finished"
    fs = attempts.faults(led)
    # the ledger is written at most once a second (and at each save): on these 40 ms steps the
    # recorded last step may trail the true one
    assert [f.resumed_from for f in fs] == [3, 6]
    assert all(f.resumed_from <= f.step <= died for f, died in zip(fs, (4, 8), strict=True))
    assert all(f.restart_s > 0 for f in fs)
    assert "goodput " in out and "2 fault(s)/stop(s) cost" in out


def test_a_restart_loop_failing_at_one_step_says_so(tmp_path):
    """Every attempt raises in step 5 (a bug, not the hardware): after the launcher's limit the
    job ends, and the last attempt's failing rank names the step, the rank and the attempts."""
    p = _launch(tmp_path, "loop", "raise:step:1:5", 1)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-4000:]
    assert "restart 1 of --max-restarts=1: resuming from step 3" in out, out[-4000:]
    want = "rank 1 failed in step 5: RuntimeError: injected fault raise:step:1:5:1 (MBR_FAULT). Attempts 0 and 1 all "
    assert want + "failed in step 5: the launcher's restart limit (--max-restarts=1) is reached" in out, out[-4000:]
    record = (tmp_path / "loop" / "run" / "faults" / "attempt_1" / "rank_1.txt").read_text()
    assert "Attempts 0 and 1 all failed in step 5" in record and "Traceback" in record
