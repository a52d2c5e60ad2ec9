"""train/orphans.py with real processes but no torch: stand-in launchers (Python processes whose
argv names a launcher, as torchrun's and deepspeed's do) start a rank that arms
`die_with_launcher()`; SIGKILLing the launcher must end the rank with its one-line reason.
The real torchrun and `deepspeed` launchers are killed in tests/reliability."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc and prctl")

RANK = textwrap.dedent(
    """
    import sys, time
    from megatron_bridge.train.orphans import die_with_launcher
    armed = die_with_launcher()
    open(sys.argv[1], "w").write("armed" if armed else "not armed")
    time.sleep(60)
    """
)
# A launcher: `python -c LAUNCHER NAME PIDFILE CHILD...` (NAME is the 4th word of its
# /proc cmdline, where orphans.py looks); it starts CHILD (the rank, or another launcher) and waits.
LAUNCHER = textwrap.dedent(
    """
    import subprocess, sys, time
    p = subprocess.Popen(sys.argv[3:])
    open(sys.argv[2], "w").write(str(p.pid))
    time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_file(p: Path, limit: float = 60) -> str:
    t0 = time.monotonic()
    while not (p.exists() and p.read_text()):
        assert time.monotonic() - t0 < limit, f"{p} never written"
        time.sleep(0.05)
    return p.read_text()


def run_chain(tmp_path, names, kill: int, env_extra=None, rank: str = RANK):
    """Start launchers `names` (outermost first) and a rank (Python source `rank`); SIGKILL
    launcher `kill`."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), **(env_extra or {})}
    log = open(tmp_path / "rank.log", "w")
    inner = [sys.executable, "-c", rank, str(tmp_path / "armed")]
    for i in reversed(range(len(names))):
        inner = [sys.executable, "-c", LAUNCHER, names[i], str(tmp_path / f"pid{i}"), *inner]
    top = subprocess.Popen(inner, env=env, stderr=log, start_new_session=True)
    pids = [top.pid]
    for i in range(len(names)):
        pids.append(int(_wait_file(tmp_path / f"pid{i}")))
    rank = pids[-1]
    armed = _wait_file(tmp_path / "armed")
    try:
        if armed == "armed":
            os.kill(pids[kill], signal.SIGKILL)
            t0 = time.monotonic()
            while _alive(rank) and time.monotonic() - t0 < 15:
                time.sleep(0.05)
        gone = not _alive(rank)
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        top.wait()
        log.close()
    return armed, gone, pids, (tmp_path / "rank.log").read_text()


def test_rank_ends_with_its_torchrun(tmp_path):
    armed, gone, pids, log = run_chain(tmp_path, ["torchrun"], kill=0, env_extra={"LOCAL_RANK": "0", "RANK": "3"})
    assert armed == "armed" and gone, log
    assert f"rank 3: launcher torchrun (pid {pids[0]}) is gone; exiting so no orphaned rank keeps training" in log


def test_rank_ends_when_the_deepspeed_runner_above_its_parent_dies(tmp_path):
    # deepspeed runner -> launch.py -> rank: the rank's parent survives the runner
    armed, gone, pids, log = run_chain(
        tmp_path, ["deepspeed", "deepspeed.launcher.launch"], kill=0, env_extra={"LOCAL_RANK": "0", "RANK": "1"}
    )
    assert armed == "armed" and gone, log
    assert f"rank 1: launcher deepspeed (pid {pids[0]}) is gone" in log


def test_a_run_that_can_save_stops_instead_but_a_hung_rank_still_ends(tmp_path):
    # deepspeed runner -> launch.py -> rank whose run has a checkpoint directory (a stop hook):
    # the runner's death calls the hook instead of ending the rank; the rank, which never reaches
    # a step boundary here, still ends when its STOP_S (1 s here) is up.
    rank = RANK.replace(
        "armed = die_with_launcher()",
        "from megatron_bridge.train import orphans\n"
        "orphans.STOP_S = 1.0\n"
        "orphans.stop_instead(lambda: open(sys.argv[1] + '.stop', 'w').write('stop'))\n"
        "armed = die_with_launcher()",
    )
    armed, gone, pids, log = run_chain(
        tmp_path,
        ["deepspeed", "deepspeed.launcher.launch"],
        kill=0,
        env_extra={"LOCAL_RANK": "0", "RANK": "1"},
        rank=rank,
    )
    assert armed == "armed" and gone, log
    assert (tmp_path / "armed.stop").read_text() == "stop"
    assert f"rank 1: launcher deepspeed (pid {pids[0]}) is gone while this rank's own launcher lives on" in log
    assert f"rank 1: launcher deepspeed (pid {pids[0]}) is gone; exiting so no orphaned rank keeps training" in log


def test_nothing_armed_outside_a_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    p = subprocess.run(
        [sys.executable, "-c", RANK.replace("time.sleep(60)", ""), str(tmp_path / "armed")],
        env={**env, "PYTHONPATH": str(Path(__file__).resolve().parents[3])},
        timeout=60,
    )
    assert p.returncode == 0 and (tmp_path / "armed").read_text() == "not armed"


def test_the_handler_and_the_watch_thread_together_print_the_line_once(tmp_path):
    # The SIGUSR2 handler and the watch thread can notice the same death at once (seen in a full
    # multi-process run: a rank printed its line twice); stderr is made slow so both print at once.
    race = textwrap.dedent(
        """
        import os, sys, threading, time
        from megatron_bridge.train import orphans
        orphans._armed.append((os.getpid(), -1, "torchrun"))  # a parent that is not ours: gone

        class Slow:
            def write(self, s):
                time.sleep(0.3)
                return sys.__stderr__.write(s)

            def flush(self):
                sys.__stderr__.flush()

        sys.stderr = Slow()
        threads = [threading.Thread(target=orphans._exit_if_orphaned) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", race],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3]), "RANK": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1, p.stderr
    assert p.stderr.count("rank 2: launcher torchrun (pid -1) is gone; exiting") == 1, p.stderr
