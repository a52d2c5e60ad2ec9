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
    POINT   step          mid-step: when the step draws its second micro-batch (its first
                          has run forward/backward; pipeline peers are mid-schedule)
            ckpt_write    checkpoint STEP: after this rank wrote its file into iter_N.tmp/
            ckpt_publish  checkpoint STEP, rank 0: manifest written, directory not renamed
            ckpt_latest   checkpoint STEP, rank 0: directory renamed, `latest` not updated
    RANKS   a global rank, several joined by `+` (1+3), or `*` for every rank
    STEP    the 1-based training step (for checkpoints: the iteration being saved)

e.g. `MBR_FAULT=kill:step:1:5` kills rank 1 in the middle of step 5. With `MBR_FAULT_DIR`
set, each firing first writes `DIR/fault.rankR` (the time, for tests measuring how fast the
job ends). The spec is read at each call, so it costs one dict lookup when unset.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

FAULT_ENV = "MBR_FAULT"
FAULT_DIR_ENV = "MBR_FAULT_DIR"
ACTIONS = ("kill", "raise", "hang", "pause", "nan", "term", "usr1")
POINTS = ("step", "ckpt_write", "ckpt_publish", "ckpt_latest")
WATCHDOG_EXIT = 1


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _parse(spec: str) -> list[tuple[str, str, str, int]]:
    out = []
    for entry in filter(None, (e.strip() for e in spec.split(","))):
        parts = entry.split(":")
        if len(parts) != 4 or parts[0] not in ACTIONS or parts[1] not in POINTS or not parts[3].isdigit():
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: entries are ACTION:POINT:RANKS:STEP with ACTION in {ACTIONS} "
                f"and POINT in {POINTS}, e.g. kill:step:1:5"
            )
        out.append((parts[0], parts[1], parts[2], int(parts[3])))
    return out


def planned(point: str, step: int) -> str | None:
    """The action `MBR_FAULT` plans for this rank at (point, step), or None."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    rank = _rank()
    for action, p, ranks, s in _parse(spec):
        if p == point and s == step and (ranks == "*" or rank in {int(r) for r in ranks.split("+")}):
            return action
    return None


def fault(point: str, step: int) -> None:
    """Fire the fault `MBR_FAULT` plans for this rank at (point, step); no-op otherwise."""
    action = planned(point, step)
    if action is None:
        return
    rank = _rank()
    what = f"{action}:{point}:{rank}:{step}"
    d = os.environ.get(FAULT_DIR_ENV)
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / f"fault.rank{rank}").write_text(f"{time.time()} {what}\n")
    print(f"[{FAULT_ENV}] rank {rank}: injecting {what}", file=sys.stderr, flush=True)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
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


# -- watchdog ---------------------------------------------------------------------------------
class Watchdog:
    """Exit this rank when an armed phase (a step, a checkpoint save) exceeds `timeout_s`
    (<= 0: never)."""

    def __init__(self, timeout_s: float, rank: int, *, hint: str = "") -> None:
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self.hint = hint
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
                print(
                    f"rank {self.rank} failed in {what}: no progress for {self.timeout_s:.0f} s "
                    f"({self.hint or 'the watchdog timeout'}); stuck at {where}. Exiting so that the "
                    "whole job ends instead of hanging.",
                    file=sys.stderr,
                    flush=True,
                )
                if waiting:
                    # Let the rank that is stuck by itself exit first: the launcher's report then
                    # names it as the first failure (it stops everyone else at once).
                    time.sleep(min(5.0, max(1.0, self.timeout_s / 4)))
                os._exit(WATCHDOG_EXIT)


__all__ = ["FAULT_ENV", "FAULT_DIR_ENV", "fault", "planned", "faulty_iterator", "failure_message", "Watchdog"]
