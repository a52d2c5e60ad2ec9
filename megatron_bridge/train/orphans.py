"""No orphaned ranks: a training rank ends itself within a second of its launcher's death.

torchrun starts every worker in its own session, so a SIGKILLed torchrun agent (the OOM
killer, `kill -9`, a lost node agent) leaves its ranks re-parented to PID 1, training on and
writing checkpoints with nobody watching — and a restarted job then shares the checkpoint
directory (and the GPUs) with them. The `deepspeed` launcher is two processes: the `deepspeed`
runner starts `deepspeed.launcher.launch`, which starts the ranks; SIGKILL the runner and
launch.py lives on, so the ranks' own parent never dies. Hence two mechanisms, armed by
`die_with_launcher()` first thing in the trainer, under a launcher only (LOCAL_RANK /
TORCHELASTIC_RUN_ID set, or a known launcher as the parent):

  * `prctl(PR_SET_PDEATHSIG, SIGUSR2)` (Linux): the kernel signals this rank the moment its
    parent exits; the handler checks the parent really changed and exits;
  * a watch thread, twice a second, checks that the parent is still the launcher and that
    each launcher process above it (launch.py's `deepspeed` runner) is still its parent. The
    thread also covers a main thread blocked inside a collective, where Python runs no signal
    handler.

Either prints one line — `rank R: launcher torchrun (pid P) is gone; exiting so no orphaned
rank keeps training` — and ends the process with status 1 (os._exit: no cleanup that could
block). A checkpoint being written stays an unpublished `iter_N.tmp` (checkpoint.py), and the
lease on the checkpoint directory is taken over by the next job (lease.py: its pid is gone).

One exception, `stop_instead()`: a launcher ABOVE a rank's live parent — the `deepspeed`
runner, which on one node dies of SIGTERM without forwarding it (`kill RUNNER_PID`, a
supervisor signalling only the process it started) — is what a preemption looks like from the
rank. A run that has somewhere to save (`checkpoint.dir`, train/guard.py registers the hook)
then stops as on SIGTERM: the hook notes the stop, every rank saves the step under way at its
boundary and exits 0; the rank has `STOP_S` to reach that boundary (a rank hung in a
collective still ends within seconds), then the save gets `guard.PREEMPT_GRACE_S`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

EXIT = 1
PERIOD_S = 0.5
STOP_S = 8.0  # how long a rank whose launcher above its live parent died has to reach a step boundary
# argv word (basename, .py dropped) -> the launcher it names
LAUNCHERS = {
    "torchrun": "torchrun",
    "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torchrun",
    "deepspeed": "deepspeed",
    "deepspeed.launcher.runner": "deepspeed",
    "deepspeed.launcher.launch": "deepspeed's launch.py",
    "srun": "srun",
    "slurmstepd": "srun's slurmstepd",
    "megatron_bridge.fork_launch": "fork_launch",  # the test suite's launcher (fork_launch.py)
    "megatron_bridge.fork_server": "fork_launch",  # the same, forked from the suite's fork_server.py
}
_armed: list[tuple[int, int, str]] = []  # (pid, its parent's pid, the parent's name), child first
_grace_until = 0.0  # time.monotonic() before which a gone launcher does not end this rank (`defer`)
_stop_hooks: list[Callable[[], None]] = []  # `stop_instead`; emptied when they have run
# Held by whichever caller acts on a gone launcher: the signal handler (main thread) and the
# watch thread can notice the same death at once, and the line must be printed once.
_acting = threading.Lock()


def _stat(pid: int) -> tuple[int, str] | None:
    """(ppid, launcher name or '') of a live process, None if it is gone (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:4]
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    words = [Path(a.decode(errors="replace")).name.split(":")[0].removesuffix(".py") for a in argv]
    return int(fields[1]), next((LAUNCHERS[w] for w in words if w in LAUNCHERS), "")


def _chain() -> list[tuple[int, int, str]]:
    """[(me, parent, parent's name), (parent, grandparent, its name), ...] while the parent is a
    launcher started by another launcher (deepspeed: rank -> launch.py -> runner)."""
    parent = os.getppid()
    st = _stat(parent)
    out = [(os.getpid(), parent, st[1] if st and st[1] else "process")]
    while st and st[1] and st[0] > 1:
        up = _stat(st[0])
        if not up or not up[1]:
            break
        out.append((out[-1][1], st[0], up[1]))
        st = up
    return out


def _gone() -> tuple[str, int, bool] | None:
    """(name, pid, whether this rank's own parent is still there) of a launcher process that is
    gone, or None."""
    for child, parent, name in _armed:
        mine = child == os.getpid()
        now = os.getppid() if mine else (_stat(child) or (0, ""))[0]
        if now != parent:
            return name, parent, not mine
    return None


def defer(seconds: float) -> None:
    """A preemption signal reached this rank (train/guard.py): it saves at the next step boundary
    and exits. A launcher that dies meanwhile — Slurm signals every process of the step, and
    the single-node `deepspeed` runner dies of SIGTERM without forwarding it — ends the rank only
    after `seconds`, so the save is not cut short."""
    global _grace_until
    _grace_until = max(_grace_until, time.monotonic() + seconds)


def stop_instead(hook: Callable[[], None]) -> Callable[[], None]:
    """Call `hook` (once, from the watch thread) instead of ending this rank when a launcher
    above its live parent dies, and give the rank `STOP_S` to act on it (module docstring).
    Returns what unregisters it."""
    _stop_hooks.append(hook)
    return lambda: _stop_hooks.remove(hook) if hook in _stop_hooks else None


def _exit_if_orphaned() -> None:
    gone = _gone()
    if not gone or not _acting.acquire(blocking=False):
        return  # nothing gone, or the other caller (handler or watch thread) is acting on it
    try:
        rank = os.environ.get("RANK", "?")
        if gone[2] and _stop_hooks:
            defer(STOP_S)
            print(
                f"rank {rank}: launcher {gone[0]} (pid {gone[1]}) is gone while this rank's own launcher lives on: "
                "stopping after the step under way and saving it, as on SIGTERM",
                file=sys.stderr,
                flush=True,
            )
            hooks = list(_stop_hooks)
            _stop_hooks.clear()
            for hook in hooks:
                hook()
            return
        if time.monotonic() >= _grace_until:
            print(
                f"rank {rank}: launcher {gone[0]} (pid {gone[1]}) is gone; exiting so no orphaned rank keeps training",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT)
    finally:
        _acting.release()


def _watch() -> None:
    while True:
        threading.Event().wait(PERIOD_S)
        _exit_if_orphaned()


def under_launcher() -> bool:
    if os.environ.get("LOCAL_RANK") is not None or os.environ.get("TORCHELASTIC_RUN_ID"):
        return True
    st = _stat(os.getppid())
    return bool(st and st[1])


def die_with_launcher() -> bool:
    """Arm both mechanisms (once per process) when running under a launcher. Returns whether
    they are armed."""
    if _armed:
        return True
    if not sys.platform.startswith("linux") or not under_launcher():
        return False
    _armed.extend(_chain())
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR2, lambda *_: _exit_if_orphaned())
            libc.prctl(pr_set_pdeathsig, int(signal.SIGUSR2), 0, 0, 0)
    except (OSError, AttributeError, ValueError):
        pass  # the watch thread alone still bounds it by PERIOD_S
    _exit_if_orphaned()  # the parent may have died between reading the chain and arming the signal
    threading.Thread(target=_watch, name="mbr-launcher-watch", daemon=True).start()
    return True


__all__ = ["die_with_launcher", "under_launcher", "stop_instead", "defer", "LAUNCHERS", "STOP_S"]
