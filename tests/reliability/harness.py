"""Launch training jobs under a real torchrun and watch them fail: exit status, output, how fast
the whole job ended after a fault fired, and that no process of the launch survived.

`launch(jobs, nproc, out)` runs tests/reliability/scripts/jobs.py (several training jobs in one
launch, each with an optional `MBR_FAULT`). With `kill_when=N` the harness itself SIGKILLs the
whole launch — torchrun agent and every worker — once N ranks have reached their injected
`hang` fault: the "whole job killed -9" case (a node lost, a preempted allocation); with
`agent_only=True` it SIGKILLs only the torchrun agent and measures how long its ranks outlive
it (`Launch.orphans_gone`; megatron_bridge/train/orphans.py ends them). With `term_agent_when=N`
it sends the torchrun agent SIGTERM (a preemption) once N ranks sit in their `pause` fault, then
lets them go on (the agent forwards the signal; the ranks save and exit 0). Every launch is bounded
by `timeout`: on expiry everything is killed and `LaunchTimeout` raised. `spawn` starts a
command (torchrun, the deepspeed launcher) in the background with the same environment.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_bridge.testing import _kill_tree, _process_tree, torchrun_cmd

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/reliability/scripts/jobs.py"
SURVIVOR_GRACE = 5.0
ORPHAN_LIMIT = 60.0  # how long agent_only waits for the ranks (the tests' bound is lower)


class LaunchTimeout(AssertionError):
    pass


@dataclass
class Launch:
    rc: int
    output: str
    wall: float  # seconds from start to the launcher's exit
    ended: float  # time.time() when the launcher exited
    killed: bool  # the harness killed the whole launch (kill_when)
    faults: dict[int, float] = field(default_factory=dict)  # rank -> time.time() its fault fired
    survivors: list[str] = field(default_factory=list)  # "pid cmdline" of processes alive after the exit
    results: dict[str, dict[str, float]] = field(default_factory=dict)  # finished jobs' losses
    orphans_gone: float | None = None  # agent_only: seconds from the agent's SIGKILL to its last rank's exit

    @property
    def exit_after_fault(self) -> float | None:
        """Seconds from the first fault firing to the whole launch having exited."""
        return self.ended - min(self.faults.values()) if self.faults else None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def job_env(faults: Path, fault: str = "") -> dict[str, str]:
    """The environment of a launch: no inherited rank variables, faults reported under `faults`."""
    if faults.exists():
        for f in faults.iterdir():
            f.unlink()
    env = {k: v for k, v in os.environ.items() if k not in ("MBR_FAULT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(
        {
            "MBR_FAULT_DIR": str(faults),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore",
            "MBR_T0": str(time.time()),
        }
    )
    if fault:
        env["MBR_FAULT"] = fault
    return env


def torchrun(nproc: int, *args: str) -> list[str]:
    return torchrun_cmd(nproc, *args)


def spawn(cmd: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `cmd` in the background (its own session), output to `log`."""
    with open(log, "wb") as f:
        return subprocess.Popen(
            list(cmd), cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_gone(pids: Sequence[int], limit: float) -> float | None:
    """Seconds until every process in `pids` has exited (None: some still alive after `limit`)."""
    t0 = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - t0 > limit:
            return None
        time.sleep(0.05)
    return time.monotonic() - t0


def children(pid: int) -> list[int]:
    return [p for p in _process_tree(pid)[1:] if _ppid(p) == pid]


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def launch(
    jobs: Sequence[str],
    nproc: int,
    out: Path,
    *,
    timeout: float = 300,
    kill_when: int | None = None,
    agent_only: bool = False,
    term_agent_when: int | None = None,
) -> Launch:
    out = Path(out)
    faults = out / "faults"
    out.mkdir(parents=True, exist_ok=True)
    env = job_env(faults)
    cmd = torchrun(nproc, SCRIPT, str(out), *jobs)
    log = out / f"launch-{int(time.time() * 1000)}.log"
    t0 = time.monotonic()
    seen: set = set()
    killed = False
    orphans_gone = None
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                seen.update(_process_tree(proc.pid)[1:])
                fired_n = len(list(faults.glob("fault.rank*"))) if faults.exists() else 0
                if term_agent_when is not None and fired_n >= term_agent_when and not (faults / "continue").exists():
                    os.kill(proc.pid, signal.SIGTERM)  # the agent forwards it to its ranks, paused mid-step
                    time.sleep(0.5)
                    (faults / "continue").write_text("")
                if kill_when is not None and fired_n >= kill_when:
                    time.sleep(0.2)  # every rank is inside its fault: kill the job mid-step
                    if agent_only:  # the agent alone: its ranks must notice and end themselves
                        ranks = children(proc.pid)
                        os.kill(proc.pid, signal.SIGKILL)
                        proc.wait()
                        orphans_gone = wait_gone(ranks, ORPHAN_LIMIT)
                    _kill_tree(proc)
                    killed = True
                    break
                if time.monotonic() - t0 > timeout:
                    _kill_tree(proc)
                    raise LaunchTimeout(
                        f"launch did not end within {timeout:.0f} s; everything was killed\n"
                        + log.read_text(errors="replace")[-8000:]
                    )
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    rc = proc.wait()
    ended = time.time()
    wall = time.monotonic() - t0
    # torchrun has stopped its workers; helpers they spawned (multiprocessing's resource tracker)
    # notice their parent's exit a moment later. Anything left after SURVIVOR_GRACE s is a survivor.
    deadline = time.monotonic() + SURVIVOR_GRACE
    survivors = [pid for pid in sorted(seen) if _alive(pid)]
    while survivors and time.monotonic() < deadline:
        time.sleep(0.1)
        survivors = [pid for pid in survivors if _alive(pid)]
    named = [f"{pid} {_cmdline(pid)}" for pid in survivors]
    for pid in survivors:  # report them, but leave no process behind
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    survivors = named
    fired = {}
    if faults.exists():
        for f in faults.glob("fault.rank*"):
            fired[int(f.name.split("rank")[1])] = float(f.read_text().split()[0])
    res_path = out / "results.json"
    results = json.loads(res_path.read_text()) if res_path.exists() else {}
    output = log.read_text(errors="replace")
    return Launch(rc, output, wall, ended, killed, fired, survivors, results, orphans_gone)


def torchrun_failures(output: str) -> dict[int, int]:
    """{global rank: exit code} from torchrun's failure report (negative: killed by that signal)."""
    found = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", output)
    return {int(r): int(c) for r, c in found}


def losses(run_dir: Path) -> dict[str, float]:
    """Per-step losses a (possibly crashed) job logged to its metrics.jsonl."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        return {}
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return {str(r["step"]): r["loss"] for r in rows}
