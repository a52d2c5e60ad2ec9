"""A host that vanishes under a multi-node c10d rendezvous: two torchrun agents on this machine
("nodes" of 1 rank each), started with the command lines `mbr launch cluster.nodes=2
max_restarts=2 --dry-run` prints (a fresh rendezvous store per round, `checkpoint.resume=auto`).

  1. Both ranks are held in step 5; the second agent's whole process tree is SIGKILLed (its
     host is gone). The surviving agent's rank fails in its next collective, the agent starts
     a new rendezvous round, and a replacement agent (the same command) joins it: the job
     resumes from the step-4 checkpoint and goes on.
  2. Past step 9 the replacement vanishes too and nobody replaces it: the survivor's
     rendezvous times out (`join_timeout`) and it exits non-zero, the checkpoints intact.
  3. Launching the two agents again (what a scheduler's requeue does) resumes from the latest
     checkpoint and finishes.

Every logged loss — both attempts' recomputed steps included — equals a run without faults.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bridge.testing import free_port

pytestmark = pytest.mark.dist

STEPS = 14
JOIN_TIMEOUT_S = 20
ARGS = [
    "recipe=default",
    "data=synthetic",
    f"train.steps={STEPS}",
    "train.seq_length=32",
    "train.global_batch_size=4",
    "checkpoint.save_interval=2",
    "train.timeout_minutes=0.5",
]


def _commands(tmp: Path) -> tuple[dict[str, str], list[list[str]]]:
    """The two agents' environment and argv, as `mbr launch` prints them."""
    p = subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", "launch", *ARGS, "cluster.nodes=2", "cluster.gpus_per_node=1",
         "cluster.hostnames=[127.0.0.1,127.0.0.1]", f"cluster.master_port={free_port()}", "max_restarts=2",
         "job_name=vanish", f"checkpoint.dir={tmp / 'ck'}", f"run_dir={tmp / 'run'}", "--dry-run"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stdout.splitlines() if " torchrun " in f" {ln} "]
    assert len(lines) == 2 and all(ln.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ") for ln in lines)
    argvs = []
    for ln in lines:
        env_kv, _torchrun, *rest = shlex.split(ln)
        # torchrun's defaults shortened: a join timeout of 600 s (step 2 waits it out) and a dead
        # node dropped from the rendezvous after 3 missed 5 s keep-alives (step 1 waits for that)
        conf = f"join_timeout={JOIN_TIMEOUT_S},keep_alive_interval=1,keep_alive_max_attempt=3"
        argvs.append([sys.executable, "-m", "torch.distributed.run", f"--rdzv-conf={conf}", *rest])
    key, value = env_kv.split("=", 1)
    return {key: value}, argvs


def _env(extra: dict[str, str], faults: Path, fault: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MBR_FAULT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(extra, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MBR_FAULT_DIR=str(faults))
    if fault:
        env["MBR_FAULT"] = fault
    return env


def _agent(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(cond, what: str, procs, limit: float = 120.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.1)


def _vanish(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGKILL)  # the agent and its rank: the host is gone
    p.wait()


def _losses(run: Path) -> list[tuple[int, float]]:
    p = run / "metrics.jsonl"
    rows = [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()] if p.exists() else []
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_vanished_host_is_replaced_or_times_out_and_the_job_resumes(tmp_path):
    env_kv, (cmd0, cmd1) = _commands(tmp_path / "job")
    faults = tmp_path / "faults"
    ref = subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", "launch", *ARGS, "cluster.gpus_per_node=2",
         f"cluster.master_port={free_port()}", f"checkpoint.dir={tmp_path / 'ref/ck'}", f"run_dir={tmp_path / 'ref/run'}"],
        env=_env({}, tmp_path / "ref_faults"), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = dict(_losses(tmp_path / "ref" / "run"))
    assert sorted(want) == list(range(1, STEPS + 1))

    logs = tmp_path / "logs"
    logs.mkdir()
    held = _env(env_kv, faults, "pause:step:*:5:0")
    survivor = _agent(cmd0, held, logs / "a.log")
    time.sleep(1.0)  # the first agent hosts the rendezvous store; the one that vanishes must not
    procs = [survivor, _agent(cmd1, held, logs / "b.log")]
    try:
        # 1. both ranks held in step 5; the second host vanishes; a replacement joins
        _wait(lambda: len(list(faults.glob("fault.rank*"))) == 2, "both ranks in step 5", procs)
        _vanish(procs[1])
        (faults / "continue").write_text("")
        procs.append(_agent(cmd1, held, logs / "c.log"))
        _wait(
            lambda: max((s for s, _ in _losses(tmp_path / "job/run")), default=0) >= 9, "step 9", [survivor, procs[2]]
        )
        # 2. the replacement vanishes too, and nobody replaces it
        _vanish(procs[2])
        t0 = time.monotonic()
        rc = survivor.wait(timeout=JOIN_TIMEOUT_S + 90)
        alone = (logs / "a.log").read_text(errors="replace")
        assert rc != 0 and "RendezvousTimeoutError" in alone, alone[-4000:]
        assert time.monotonic() - t0 < JOIN_TIMEOUT_S + 60
        # 3. the scheduler launches both again: resume from the latest checkpoint, finish
        again = [_agent(cmd0, _env(env_kv, faults), logs / "d.log")]
        time.sleep(1.0)
        again.append(_agent(cmd1, _env(env_kv, faults), logs / "e.log"))
        procs += again
        for p in again:
            assert p.wait(timeout=300) == 0, "\n".join((logs / n).read_text(errors="replace")[-3000:] for n in "de")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    out = "".join((logs / f"{n}.log").read_text(errors="replace") for n in "abcde")
    assert "restart 1 of --max-restarts=2: resuming from step 4" in out, out[-4000:]
    assert "relaunched as attempt 2: resuming from step " in out  # torchrun counts from 0 again; the run does not
    got = _losses(tmp_path / "job" / "run")
    assert {s for s, _ in got} == set(range(1, STEPS + 1))
    for step, loss in got:  # every attempt's rows, recomputed steps too
        assert loss == want[step], (step, loss, want[step])
    assert not list((tmp_path / "job" / "ck").glob("iter_*.tmp"))  # a save torn by a vanished host is swept
