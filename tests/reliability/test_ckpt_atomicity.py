"""A real SIGKILL at every point of a checkpoint save (one process, no launcher): afterwards
`latest` names the previous complete checkpoint, `load()` returns it, `mbr check-ckpt` passes,
and the next save cleans up. The multi-process versions (a rank or the whole job killed mid-
write, then resumed bit-exactly) are in test_crash_resume.py. Also: the fault-injection
grammar, the watchdog, and the failure message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_bridge import reliability
from megatron_bridge.cli import main as mbr
from megatron_bridge.train import checkpoint as ckpt
from megatron_bridge.train import manifest

SAVE_TWICE = textwrap.dedent("""
    import sys, torch
    from megatron_bridge.train import checkpoint as c
    c.save(sys.argv[1], 2, {"w": torch.ones(3)}, {"layout": "x"})
    c.save(sys.argv[1], 4, {"w": torch.full((3,), 2.0)}, {"layout": "x"})
""")


def _env(**kw):
    env = {k: v for k, v in os.environ.items() if k not in ("MBR_FAULT", "RANK", "WORLD_SIZE")}
    env.update(kw)
    return env


@pytest.mark.parametrize(
    "point,left",
    [
        ("ckpt_write", "iter_0000004.tmp"),  # this rank's file written, nothing published
        ("ckpt_publish", "iter_0000004.tmp"),  # manifest written, directory not renamed
        ("ckpt_latest", "iter_0000004"),  # directory renamed, the latest pointer not updated
    ],
)
def test_sigkill_during_save_keeps_the_previous_checkpoint(point, left, tmp_path):
    d = tmp_path / "ck"
    p = subprocess.run(
        [sys.executable, "-c", SAVE_TWICE, str(d)],
        env=_env(MBR_FAULT=f"kill:{point}:0:4"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert f"injecting kill:{point}:0:4" in p.stderr
    assert (d / left).is_dir()
    assert manifest.latest_iteration(d) == 2
    it, state = ckpt.load(d, {"layout": "x"})
    assert it == 2 and state["w"].tolist() == [1.0, 1.0, 1.0]
    assert mbr(["check-ckpt", str(d), "--all"]) == 0
    ckpt.save(d, 6, {"w": 3}, {"layout": "x"})  # the next save publishes and cleans up
    assert manifest.latest_iteration(d) == 6 and not list(d.glob("*.tmp"))


def test_fault_spec_grammar(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(reliability.FAULT_ENV, "kill:step:1+3:5,raise:ckpt_write:*:4")
    assert reliability.planned("step", 5) == "kill"
    assert reliability.planned("step", 4) is None
    assert reliability.planned("ckpt_write", 4) == "raise"
    monkeypatch.setenv("RANK", "2")
    assert reliability.planned("step", 5) is None
    with pytest.raises(RuntimeError, match="injected fault raise:ckpt_write:2:4"):
        reliability.fault("ckpt_write", 4)
    monkeypatch.setenv(reliability.FAULT_ENV, "explode:step:1:5")
    with pytest.raises(ValueError, match="ACTION:POINT:RANKS:STEP"):
        reliability.planned("step", 5)
    monkeypatch.delenv(reliability.FAULT_ENV)
    assert reliability.planned("step", 5) is None  # inert without MBR_FAULT


def test_watchdog_ends_a_stuck_rank_and_says_where():
    code = textwrap.dedent("""
        import time
        from megatron_bridge.reliability import Watchdog
        w = Watchdog(1.0, rank=3, hint="train.timeout_minutes=0.0167")
        w.arm("step 7")
        def wait_for_peer():
            time.sleep(60)
        wait_for_peer()
    """)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    took = time.monotonic() - t0
    assert p.returncode == reliability.WATCHDOG_EXIT
    assert "rank 3 failed in step 7: no progress for 1 s (train.timeout_minutes=0.0167)" in p.stderr
    assert "in wait_for_peer" in p.stderr and "this rank itself is stuck" in p.stderr and took < 30


def test_watchdog_disarmed_does_nothing():
    w = reliability.Watchdog(0.2, rank=0)
    w.arm("step 1")
    w.disarm()
    time.sleep(0.6)
    w.close()  # still alive: it did not fire


def test_failure_message_names_rank_phase_and_peer_hint():
    e = RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    msg = reliability.failure_message(2, "step 5", e)
    assert msg.startswith("rank 2 failed in step 5: RuntimeError: [gloo/pair.cc:553] Connection closed by peer")
    assert "another rank died or hangs" in msg
    assert "another rank" not in reliability.failure_message(0, "step 1", ValueError("bad"))
