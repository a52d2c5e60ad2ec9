"""The attempts of one run and what each fault cost: `checkpoint.dir/mbr_attempts.json`.

A job that restarts itself (torchrun `--max-restarts`, a Slurm requeue, a k8s pod restart) is
one run made of attempts. Rank 0 keeps a small ledger next to the checkpoints — the place that
outlives every attempt — with, per attempt, when it started, its first step, the last step it
finished and when, and when each of its checkpoints' steps ended. From it the next attempt
knows, without asking anyone, what the fault cost:

  * recompute: the time the failed attempt spent on steps after the checkpoint the new one
    resumes from — work done twice;
  * restart: from the failed attempt's last finished step to the new attempt's first step —
    detection (the watchdog, the launcher), teardown, relaunch, imports, build and load.

goodput = (wall time − startup of the first attempt − time lost to faults) / wall time. The
ledger also carries the run directory, so every attempt of a run logs into one `run_dir`, and
the step each failed attempt died at (a restart loop failing at one step says so). Writes are
atomic (tmp + rename) and throttled to one a second, plus one at every save and at the end.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_bridge.train.manifest import atomic_write_bytes

LEDGER = "mbr_attempts.json"
WRITE_EVERY_S = 1.0


def attempt_number() -> int:
    """torchrun's restart count of this agent (0 = its first start, again after a requeue; the
    ledger numbers a run's attempts itself)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def read(ckpt_dir: str | Path | None) -> dict[str, Any]:
    """The ledger of `ckpt_dir` ({} when there is none or it is unreadable: it is advisory)."""
    if not ckpt_dir:
        return {}
    try:
        data = json.loads((Path(ckpt_dir) / LEDGER).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("attempts"), list) else {}


@dataclass
class Fault:
    """What one failed (or stopped) attempt cost the run."""

    attempt: int
    step: int  # the last step it finished
    resumed_from: int  # the step the next attempt resumed from
    recompute_s: float
    restart_s: float
    kind: str  # "fault" (it died) or "stop" (a signal or exit_after saved it and it ended)

    @property
    def lost_s(self) -> float:
        return self.recompute_s + self.restart_s

    def line(self) -> str:
        what = "failed after step" if self.kind == "fault" else "stopped after step"
        redo = f"{self.step - self.resumed_from} step(s) recomputed ({self.recompute_s:.1f} s)"
        return f"attempt {self.attempt} {what} {self.step}: {redo}, restart and load {self.restart_s:.1f} s"


@dataclass
class Ledger:
    """Rank 0's record of this attempt in the run's ledger (`path` None: nothing kept)."""

    path: Path | None
    data: dict[str, Any] = field(default_factory=dict)
    _written: float = 0.0

    @classmethod
    def open(cls, ckpt_dir: str | None, run_dir: Path, resumed_from: int, *, enabled: bool) -> Ledger:
        """Start this attempt's entry; a run that does not resume starts a new ledger."""
        if not (enabled and ckpt_dir):
            return cls(None)
        old = read(ckpt_dir) if (resumed_from or attempt_number()) else {}
        data = {"run_dir": str(run_dir), "attempts": old.get("attempts", [])}
        data["attempts"].append(
            {
                "attempt": len(data["attempts"]),  # its place in the run: relaunches count too
                "restart_count": attempt_number(),  # torchrun's (0 again after a requeue)
                "job_id": os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "",
                "started": _started(),
                "resumed_from": resumed_from,
                "first_step_at": None,
                "last_step": resumed_from,
                "last_step_at": None,
                "saved": {},
                "ended": None,
                "outcome": None,
            }
        )
        ledger = cls(Path(ckpt_dir) / LEDGER, data)
        ledger.write()
        return ledger

    @property
    def current(self) -> dict[str, Any]:
        return self.data["attempts"][-1]

    def first_step(self) -> None:
        if self.path:
            self.current["first_step_at"] = time.time()
            self.write()

    def step_done(self, step: int) -> None:
        if self.path:
            self.current.update(last_step=step, last_step_at=time.time())
            if time.time() - self._written >= WRITE_EVERY_S:
                self.write()

    def saved(self, step: int) -> None:
        """A checkpoint of `step` is published (its step ended at `last_step_at`)."""
        if self.path:
            self.current["saved"][str(step)] = self.current["last_step_at"] or time.time()
            self.write()

    def end(self, outcome: str) -> None:
        if self.path:
            self.current.update(ended=time.time(), outcome=outcome)
            self.write()

    def write(self) -> None:
        if self.path:
            self._written = time.time()
            atomic_write_bytes(self.path, json.dumps(self.data, indent=1).encode())

    def faults(self) -> list[Fault]:
        """What each earlier attempt's end cost, from the attempt after it."""
        return faults(self.data.get("attempts", []))

    def summary(self) -> str:
        return summary(self.data.get("attempts", []))


def _started() -> float:
    """When this process started (the attempt's start: imports count against the restart)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def faults(attempts: list[dict[str, Any]]) -> list[Fault]:
    out = []  # numbered by their place in the ledger: a requeued job's torchrun counts from 0 again
    for i, (prev, nxt) in enumerate(zip(attempts, attempts[1:], strict=False)):
        if prev.get("outcome") == "finished" or nxt.get("first_step_at") is None:
            continue
        last_at = prev.get("last_step_at") or prev.get("first_step_at") or prev["started"]
        r = nxt["resumed_from"]
        saved_at = prev.get("saved", {}).get(str(r))
        work_from = saved_at if saved_at is not None else (prev.get("first_step_at") or last_at)
        out.append(
            Fault(
                attempt=i,
                step=prev.get("last_step", r),
                resumed_from=r,
                recompute_s=max(0.0, last_at - work_from),
                restart_s=max(0.0, nxt["first_step_at"] - last_at),
                kind="stop" if prev.get("outcome") == "stopped" else "fault",
            )
        )
    return out


def goodput(attempts: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(goodput, wall seconds, seconds lost to faults and stops) of the run so far."""
    if not attempts:
        return 1.0, 0.0, 0.0
    start = attempts[0]["started"]
    end = attempts[-1].get("ended") or attempts[-1].get("last_step_at") or time.time()
    wall = max(end - start, 1e-9)
    startup = (attempts[0].get("first_step_at") or start) - start
    lost = sum(f.lost_s for f in faults(attempts))
    return max(0.0, (wall - startup - lost) / wall), wall, lost


def summary(attempts: list[dict[str, Any]]) -> str:
    """Rank 0's closing lines: goodput and what each fault cost."""
    g, wall, lost = goodput(attempts)
    fs = faults(attempts)
    head = (
        f"goodput {100 * g:.1f} % of {wall:.1f} s wall over {len(attempts)} attempt(s): "
        f"{len(fs)} fault(s)/stop(s) cost {lost:.1f} s"
    )
    return "\n".join([head] + [f"  {f.line()}" for f in fs])


def failed_steps(ckpt_dir: str | Path | None) -> list[tuple[int, int]]:
    """(attempt: its place in the ledger, step it died after) of every earlier attempt that ended without finishing or
    stopping: a restart loop that fails at one step shows it here."""
    return [
        (n, a.get("last_step", 0))
        for n, a in enumerate(read(ckpt_dir).get("attempts", [])[:-1])
        if a.get("outcome") is None
    ]


__all__ = ["LEDGER", "Ledger", "Fault", "attempt_number", "read", "faults", "goodput", "summary", "failed_steps"]
