"""What ends a training loop early without losing work (docs/train.md, "Non-finite steps" and
"Preemption"): a non-finite step, a checkpoint that would publish non-finite weights, and the
signals a scheduler sends before it kills a job.

Non-finite steps. An engine never applies a step whose loss or gradient norm is not finite
(`engines.StepResult.applied`); `NonFiniteSteps` counts them under `train.on_nonfinite=skip`
and raises `NonFinite` at once under `stop`, or after `train.max_skipped_steps` in a row.
`NonFinite` exits with `EXIT_NONFINITE` (3), not with a user error's 2: the input was
accepted, the run diverged. Nothing of the failing step is published: the loop raises before
its checkpoint save, so `latest` stays on the last good checkpoint.

Signals. `StopSignals` catches SIGTERM (Slurm and Kubernetes before a kill, torchrun's agent
and the `deepspeed` launcher forward it) and SIGUSR1 (Slurm's `--signal=USR1@SECONDS`): the
handler only notes it; `requested()` — a one-element all-reduce at every step boundary —
tells every rank the same answer, so all of them save the same step and leave together.
A run with a checkpoint directory treats the death of the `deepspeed` runner above a live
launch.py the same way (orphans.stop_instead: that runner dies of SIGTERM without forwarding
it); the answer then reads `launcher gone`.
"""

from __future__ import annotations

import signal
from typing import Any

import torch

from megatron_bridge.errors import UserError
from megatron_bridge.train.orphans import defer, stop_instead

PREEMPT_GRACE_S = 120.0  # how long a rank that got SIGTERM/SIGUSR1 outlives a dead launcher (orphans.py)

EXIT_NONFINITE = 3
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
LAUNCHER_GONE = 1  # `received` when orphans.stop_instead fired: below every signal number, so a signal's name wins


class NonFinite(UserError):
    """The run produced a non-finite loss, gradient norm or weight: one message, exit 3."""

    exit_code = EXIT_NONFINITE


class NonFiniteSteps:
    """`train.on_nonfinite` applied to each step's outcome."""

    def __init__(self, cfg: Any) -> None:
        self.policy, self.limit = cfg.train.on_nonfinite, cfg.train.max_skipped_steps
        self.in_a_row = self.total = 0

    def after(self, step: int, loss: float, grad_norm: float, applied: bool, rank: int) -> None:
        """Count a step the engine did not apply; raise `NonFinite` when the policy says stop."""
        if applied:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        what = f"step {step} has a non-finite loss or gradient norm (loss {loss:g}, grad norm {grad_norm:g})"
        if self.policy == "stop":
            raise NonFinite(
                f"{what}; training stopped (train.on_nonfinite=stop) without applying it. Nothing of this step "
                "was saved: the last checkpoint is the last good state. Lower optimizer.lr, check the data, or set "
                "train.on_nonfinite=skip to drop such steps."
            )
        if self.in_a_row >= self.limit:
            raise NonFinite(
                f"{what}: {self.in_a_row} non-finite steps in a row (train.max_skipped_steps={self.limit}); "
                "training stopped. The last checkpoint holds finite weights. Lower optimizer.lr or check the data."
            )
        if rank == 0:
            print(f"{what}: skipped ({self.in_a_row} in a row, {self.total} in all)", flush=True)


def check_finite_weights(chunks, step: int, device) -> None:
    """Collective, before a checkpoint is written: refuse to publish non-finite weights. One
    summing pass over this rank's parameters (a sum is finite iff every element is: fp32 sums of
    weights do not overflow), one all-reduce. ZeRO-3's partitioned weights are not visible here."""
    sums = [p.detach().sum(dtype=torch.float32) for c in chunks for p in c.parameters() if p.numel()]
    total = torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float32)
    bad = torch.tensor([0.0 if torch.isfinite(total) else 1.0], device=device)
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    if bad.item():
        raise NonFinite(
            f"the weights after step {step} are not finite: the checkpoint of step {step} was not written (the last "
            "published one stays `latest`). Lower optimizer.lr, or set train.on_nonfinite=skip."
        )


class StopSignals:
    """SIGTERM/SIGUSR1 noted, answered at the next step boundary by every rank alike. With
    `save_on_launcher_gone` (the run has a checkpoint directory), so is the death of a launcher
    above this rank's live parent."""

    def __init__(self, device, save_on_launcher_gone: bool = False) -> None:
        self.device, self.received = device, 0
        self._previous: dict[int, Any] = {}
        self._unhook = stop_instead(self._launcher_gone) if save_on_launcher_gone else None
        for s in SIGNALS:
            try:
                self._previous[s] = signal.signal(s, self._note)
            except ValueError:  # not the main thread (a test driving the loop): signals stay as they are
                break

    def _note(self, signum, frame) -> None:
        self.received = self.received or signum
        defer(PREEMPT_GRACE_S)  # a launcher dying of the same signal must not end the save

    def _launcher_gone(self) -> None:
        self.received = self.received or LAUNCHER_GONE

    def requested(self) -> str | None:
        """Collective: the name of a signal some rank received (SIGTERM over SIGUSR1), `launcher
        gone`, or None. A stop gives this rank `PREEMPT_GRACE_S` to save, whatever its launchers do."""
        flag = torch.tensor([float(self.received)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        code = int(flag.item())
        if not code:
            return None
        defer(PREEMPT_GRACE_S)
        return "launcher gone" if code == LAUNCHER_GONE else signal.Signals(code).name

    def close(self) -> None:
        if self._unhook:
            self._unhook()
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
