"""Failure handling of a training job: the step watchdog, failure messages naming the rank,
and test-only fault injection (inert unless `MBR_FAULT` is set).

Watchdog. `Watchdog(timeout_s)` is armed by the training loop around every step and every
checkpoint save. When one of them makes no progress for `train.timeout_minutes` (a peer rank
died or hangs in a collective, a filesystem stalls), the rank prints one line on stderr —
which rank, what it was doing, where its main thread is stuck — and exits with status 1, so
the launcher (torchrun) stops the job instead of leaving it hung for the night. The process
group timeout bounds collectives too, but megatron-core's groups take whole minutes and
nothing bounds a hang outside a collective; the watchdog bounds both.

Fault injection (tests/reliability drives it; docs/reliability.md). `MBR_FAULT` holds one
or more comma-separated `ACTION:POINT:RANKS:STEP` entries:

    ACTION  kill   SIGKILL this process (a crash: no cleanup, no message)
            raise  raise RuntimeError (a bug in one rank)
            hang   sleep forever (a rank stuck outside any collective)
            pause  sleep until the file MBR_FAULT_DIR/continue exists (a test holds a job
                   mid-run while it starts another one)
            nan    (step only) this micro-batch's loss mask becomes NaN: a non-finite loss and
                   gradient for this one step (train.on_nonfinite)
            term, usr1  send this process SIGTERM / SIGUSR1 (a scheduler's preemption notice)
            stop   SIGSTOP this process (a frozen host: not even its watchdog thread runs)
            slow   sleep MBR_FAULT_SLOW_S seconds (default 0.5) and go on (a straggler)
    POINT   step          mid-step: when the step draws its second micro-batch (its first
                          has run forward/backward; pipeline peers are mid-schedule)
            ckpt_write    checkpoint STEP: after this rank wrote its file into iter_N.tmp/
            ckpt_publish  checkpoint STEP, rank 0: manifest written, directory not renamed
            ckpt_latest   checkpoint STEP, rank 0: directory renamed, `latest` not updated
    RANKS   a global rank, several joined by `+` (1+3), or `*` for every rank
    STEP    the 1-based training step (for checkpoints: the iteration being saved), a range
            `3-9`, or `*` for every step
    ATTEMPT optional fifth field: fire only in this attempt of a restarting job
            (TORCHELASTIC_RESTART_COUNT, 0 = the first launch); `*` or absent: every attempt

e.g. `MBR_FAULT=kill:step:1:5` kills rank 1 in the middle of step 5; `kill:step:1:5:0,stop:step:0:9:1`
kills rank 1 at step 5 of the first attempt, then freezes rank 0 at step 9 of the restarted one. With `MBR_FAULT_DIR`
set, each firing first writes `DIR/fault.rankR` (the time, for tests measuring how fast the
job ends). The spec is read at each call, so it costs one dict lookup when unset.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

FAULT_ENV = "MBR_FAULT"
FAULT_DIR_ENV = "MBR_FAULT_DIR"
ACTIONS = ("kill", "raise", "hang", "pause", "nan", "term", "usr1", "stop", "slow")
POINTS = ("step", "ckpt_write", "ckpt_publish", "ckpt_latest")
WATCHDOG_EXIT = 1


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _matches(field: str, value: int) -> bool:
    """`*`, `N`, `A-B` (inclusive) or `N+M+...` against `value`."""
    if field == "*":
        return True
    if "-" in field:
        lo, hi = field.split("-", 1)
        return int(lo) <= value <= int(hi)
    return value in {int(r) for r in field.split("+")}


def _valid(field: str) -> bool:
    return field == "*" or all(p.isdigit() for p in field.replace("-", "+", 1).split("+"))


def _parse(spec: str) -> list[tuple[str, str, str, str, str]]:
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":") + ([] if entry.count(":") == 4 else ["*"])
        if (
            len(parts) != 5
            or parts[0] not in ACTIONS
            or parts[1] not in POINTS
            or not all(_valid(p) for p in parts[2:])
        ):
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: entries are ACTION:POINT:RANKS:STEP[:ATTEMPT] with ACTION in "
                f"{ACTIONS} and POINT in {POINTS}, e.g. kill:step:1:5"
            )
        out.append((parts[0], parts[1], parts[2], parts[3], parts[4]))
    return out


def planned(point: str, step: int) -> str | None:
    """The action `MBR_FAULT` plans for this rank at (point, step) in this attempt, or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    rank, attempt = _rank(), _attempt()
    for action, p, ranks, steps, attempts in _parse(spec):
        if p == point and _matches(steps, step) and _matches(ranks, rank) and _matches(attempts, attempt):
            return action
    return None


def fault(point: str, step: int) -> None:
    """Fire the fault `MBR_FAULT` plans for this rank at (point, step); no-op otherwise."""
    action = planned(point, step)
    if action is None:
        return
    rank = _rank()
    what = f"{action}:{point}:{rank}:{step}:{_attempt()}"
    if action == "slow":  # every step of a range: quiet, no record
        time.sleep(float(os.environ.get("MBR_FAULT_SLOW_S", "0.5")))
        return
    d = os.environ.get(FAULT_DIR_ENV)
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / f"fault.rank{rank}").write_text(f"{time.time()} {what}\n")
    print(f"[{FAULT_ENV}] rank {rank}: injecting {what}", file=sys.stderr, flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action in ("term", "usr1"):
        os.kill(os.getpid(), signal.SIGTERM if action == "term" else signal.SIGUSR1)
    elif action == "nan":
        return  # faulty_iterator poisons the batch
    elif action == "raise":
        raise RuntimeError(f"injected fault {what} ({FAULT_ENV})")
    elif action == "pause":
        while not (Path(d or ".") / "continue").exists():
            time.sleep(0.1)
    else:
        while True:
            time.sleep(3600)


def faulty_iterator(it: Iterator, step: int, draw: int) -> Iterator:
    """Yield from `it`, firing the `step` fault just before micro-batch number `draw` (0-based)
    is handed out. Only used when `planned("step", step)` is set for this rank."""
    for i, batch in enumerate(it):
        if i == draw:
            fault("step", step)
            if planned("step", step) == "nan":
                batch = {**batch, "loss_mask": batch["loss_mask"].float() * float("nan")}
        yield batch


# -- failure reporting ------------------------------------------------------------------------
COMMUNICATION = (
    "torch/distributed/",
    "p2p_communication",
    "megatron/core/distributed/",
    "megatron/core/tensor_parallel/mappings",
    "deepspeed/comm",
)
PEER_HINTS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "timed out",
    "Timeout",
    "ECONNRESET",
    "EPIPE",
    "NCCL communicator was aborted",
)


def failure_message(rank: int, what: str, exc: BaseException) -> str:
    """`rank R failed in WHAT: Type: message` (+ a hint when a peer's death caused it)."""
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > 600:
        text = text[:600] + " ..."
    msg = f"rank {rank} failed in {what}: {type(exc).__name__}: {text}"
    if any(h in str(exc) for h in PEER_HINTS):
        msg += (
            " (a collective broke: another rank died or hangs; the first failing rank is the cause, "
            "see the launcher's 'Root Cause')"
        )
    return msg


def record_failure(record_dir: Path | None, rank: int, text: str, *, stacks: bool = False) -> None:
    """`record_dir/rank_R.txt`: this rank's failure line (and, with `stacks`, every thread's
    Python stack, as faulthandler prints them), for the run directory and the next attempt."""
    if record_dir is None:
        return
    try:
        record_dir.mkdir(parents=True, exist_ok=True)
        with open(record_dir / f"rank_{rank}.txt", "a") as f:
            f.write(text.rstrip("\n") + "\n")
            if stacks:
                f.write("\nPython stacks of every thread:\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
    except OSError:  # a full or gone filesystem must not stop the rank from exiting
        pass


# -- watchdog ---------------------------------------------------------------------------------
class Watchdog:
    """Exit this rank when an armed phase (a step, a checkpoint save) exceeds `timeout_s`
    (<= 0: never). `record_dir`: where it leaves its line and stacks (`record_failure`);
    `silent`: the peers that stopped answering, (rank, seconds), named in its line."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        *,
        hint: str = "",
        record_dir: Path | None = None,
        silent: Callable[[], list[tuple[int, float]]] | None = None,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.hint = hint
        self.record_dir, self.silent = record_dir, silent
        self._lock = threading.Lock()
        self._deadline: float | None = None
        self._what = ""
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._run, name="mbr-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str) -> None:
        if self.timeout_s <= 0:  # disabled
            return
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + self.timeout_s

    def disarm(self) -> None:
        with self._lock:
            self._deadline = None

    def close(self) -> None:
        self._stop.set()
        self.disarm()

    def _where(self) -> tuple[str, bool]:
        """Where the main thread is stuck, and whether it is waiting on peers (a collective or a
        point-to-point transfer) rather than stuck by itself."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        if frame is None:
            return "an unknown place", False
        stack = traceback.extract_stack(frame)
        ours = [f for f in stack if "megatron_bridge" in f.filename] or stack
        inner, own = stack[-1], ours[-1]
        where = f"{Path(inner.filename).name}:{inner.lineno} in {inner.name}"
        if own is not inner:
            where += f" (called from {Path(own.filename).name}:{own.lineno} in {own.name})"
        if any(k in f.filename for f in stack for k in COMMUNICATION):
            return where + ", waiting for peer ranks in a communication call", True
        return where + ", outside any communication call: this rank itself is stuck", False

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.timeout_s / 20))):
            with self._lock:
                late = self._deadline is not None and time.monotonic() > self._deadline
                what = self._what
            if late:
                where, waiting = self._where()
                quiet = self.silent() if self.silent is not None else []
                peers = (
                    "; silent ranks (frozen, or their host is gone): "
                    + ", ".join(f"rank {r} (no heartbeat for {age:.0f} s)" for r, age in quiet)
                    if quiet
                    else ""
                )
                line = (
                    f"rank {self.rank} failed in {what}: no progress for {self.timeout_s:.0f} s "
                    f"({self.hint or 'the watchdog timeout'}); stuck at {where}{peers}. Exiting so that the "
                    "whole job ends instead of hanging."
                )
                print(line, file=sys.stderr, flush=True)
                record_failure(self.record_dir, self.rank, line, stacks=True)
                if waiting:
                    # Let the rank that is stuck by itself exit first: the launcher's report then
                    # names it as the first failure (it stops everyone else at once).
                    time.sleep(min(5.0, max(1.0, self.timeout_s / 4)))
                os._exit(WATCHDOG_EXIT)


__all__ = [
    "FAULT_ENV",
    "FAULT_DIR_ENV",
    "fault",
    "planned",
    "faulty_iterator",
    "failure_message",
    "record_failure",
    "Watchdog",
]
