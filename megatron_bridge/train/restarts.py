"""One attempt of a run that may restart itself: what the training loop tells the ledger, what
a failing rank leaves behind, and what a restarted attempt says first.

`Attempt.begin` (after the resume) opens this attempt in the run's ledger (attempts.py, rank 0)
and starts the heartbeat (heartbeats.py). A restarted attempt's rank 0 prints one line naming
the attempt, the step it resumes from and why the previous one ended (the first line each of
its ranks recorded in `run_dir/faults/attempt_K/`), and logs `faults`, `fault_lost_s` and
`goodput` with its first step. A failing rank records its line (the watchdog adds every
thread's stack) under `run_dir/faults/attempt_K/rank_R.txt`; in the launcher's last allowed
attempt it also says when earlier attempts died at the same step. The run's goodput summary
is printed at the end of any run that restarted.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.reliability import failure_message, record_failure
from megatron_bridge.train import attempts
from megatron_bridge.train.heartbeats import Heartbeats

FAULTS_DIR = "faults"


def run_dir_of(cfg) -> str | None:
    """The run directory an earlier attempt of this run used (when `run_dir` is not given and
    this launch resumes or restarts): every attempt logs into one."""
    if cfg.run_dir or not (cfg.checkpoint.resume or attempts.attempt_number()):
        return cfg.run_dir
    return attempts.read(cfg.checkpoint.dir).get("run_dir")


class Attempt:
    def __init__(self, cfg, rank: int, world: int, run_dir: Path, start: int) -> None:
        self.cfg, self.rank, self.restart_count = cfg, rank, attempts.attempt_number()
        self.run_dir = run_dir
        self.ledger = attempts.Ledger.open(cfg.checkpoint.dir, run_dir, start, enabled=rank == 0)
        # The attempt's number in the run: its place in the ledger, which also counts relaunches
        # (a Slurm requeue, a k8s pod restart: torchrun's own count starts at 0 again there).
        number = [self.ledger.current["attempt"] if self.ledger.path else self.restart_count]
        if world > 1:
            torch.distributed.broadcast_object_list(number, src=0)
        self.number: int = number[0]
        self.record_dir = run_dir / FAULTS_DIR / f"attempt_{self.number}"
        timeout = cfg.train.timeout_minutes * 60
        self.heartbeats = Heartbeats(rank, world, period=min(10.0, max(0.5, timeout / 10)))
        self._first = True
        self._pending_metrics: dict[str, float] = {}
        if rank == 0 and len(self.ledger.data.get("attempts", [])) > 1:
            self._announce(start)

    def _announce(self, start: int) -> None:
        prev, n = self.ledger.data["attempts"][-2], self.number - 1
        why = _recorded(self.run_dir / FAULTS_DIR / f"attempt_{n}")
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        of = f" of --max-restarts={limit}" if limit else ""
        head = f"restart {self.restart_count}{of}" if self.restart_count else f"relaunched as attempt {self.number}"
        ended = "stopped" if prev.get("outcome") == "stopped" else "failed"
        print(
            f"{head}: resuming from step {start}; attempt {n} {ended} after step "
            f"{prev.get('last_step', start)}" + (f": {why}" if why else " (no rank left a record: killed or frozen)"),
            flush=True,
        )

    def watchdog_args(self) -> dict[str, Any]:
        return {"record_dir": self.record_dir, "silent": self.heartbeats.silent}

    def step_started(self) -> None:
        if self._first:
            self._first = False
            self.ledger.first_step()
            fs = self.ledger.faults()
            if fs:
                g, _, lost = attempts.goodput(self.ledger.data["attempts"])
                self._pending_metrics = {
                    "faults": float(len(fs)),
                    "fault_lost_s": fs[-1].lost_s,
                    "lost_s": lost,
                    "goodput": g,
                }

    def step_done(self, step: int) -> None:
        self.ledger.step_done(step)

    def saved(self, step: int) -> None:
        self.ledger.saved(step)

    def metrics(self) -> dict[str, float]:
        """The restart figures, once, with the first logged step of a restarted attempt."""
        out, self._pending_metrics = self._pending_metrics, {}
        return out

    def failed(self, phase: str, step: int, exc: BaseException) -> str:
        """Record this rank's failure; return the line to print. Rank 0 writes the ledger now (its
        writes are throttled): the next attempts read the step this one died in from it."""
        self.ledger.write()
        line = failure_message(self.rank, phase, exc)
        limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        if limit is not None and self.restart_count >= int(limit):
            same = [a for a, s in attempts.failed_steps(self.cfg.checkpoint.dir) if s + 1 == step]
            if same:
                line += (
                    f". Attempts {', '.join(map(str, same))} and {self.number} all failed in step {step}: the "
                    f"launcher's restart limit (--max-restarts={limit}) is reached and the job ends here. A fault "
                    "at the same step every time is in the data, the config or the code, not the hardware; "
                    f"see {self.record_dir.parent}"
                )
        record_failure(self.record_dir, self.rank, line + "\n\n" + "".join(traceback.format_exception(exc)))
        return line

    def end(self, outcome: str) -> None:
        self.ledger.end(outcome)
        self.heartbeats.close()
        if self.rank == 0 and len(self.ledger.data.get("attempts", [])) > 1:
            print(self.ledger.summary(), flush=True)

    def close(self) -> None:
        self.heartbeats.close()


def _recorded(record_dir: Path) -> str:
    """The first line each rank recorded in `record_dir`, joined ('' when none did)."""
    lines = []
    for f in sorted(record_dir.glob("rank_*.txt"), key=lambda p: int(p.stem.split("_")[1])):
        try:
            first = f.read_text().splitlines()[0]
        except (OSError, IndexError):
            continue
        lines.append(first if len(first) < 300 else first[:300] + " ...")
    return "; ".join(lines)


__all__ = ["Attempt", "run_dir_of", "FAULTS_DIR"]
