"""One writer per checkpoint directory: the lease a training job holds on `checkpoint.dir`.

Two jobs saving into one directory overwrite each other's `iter_N/` and `latest` (a restart
while the orphaned first job still trains, two users sharing a path). So a job leases the
directory: `DIR/mbr_lease.json` names the holder — host, pid (global rank 0), the pid's start
time and the host's boot id (so a reused pid is not mistaken for the holder), job id, start
time — and rank 0 refreshes it every `checkpoint.lease_stale_s / 4` s from a thread and removes
it at a clean exit.

Every process of a job checks the lease right after the config is validated, before any
process group exists, so a refused job builds nothing (`UserError`, exit 2, naming the holder
and the fix). Global rank 0 takes the lease; the other ranks only read it: a live lease held by
their own job's rank 0 (same launcher on this host, or the same job key from another host) is
fine, any other live lease refuses them too. A lease whose holder is dead is taken over:
on the holder's host at once (its pid is gone, or now belongs to a process started later, or
the host rebooted), from another host once it has not been refreshed for
`checkpoint.lease_stale_s` seconds (hosts' clocks must agree to well within that). Takeovers
and refreshes happen under an fcntl lock on `DIR/mbr_lease.lock` (POSIX locks work on NFS).

Read-only uses take no lease: `mbr check-ckpt`, `mbr export`, `train.init_from`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_bridge.errors import UserError
from megatron_bridge.flock import lock_current

LEASE = "mbr_lease.json"
LOCK = "mbr_lease.lock"
JOB_ENV = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID")


def _proc_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first); [] where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _proc_start(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (Linux /proc), None where unknown."""
    fields = _proc_stat(pid)
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _job() -> tuple[str, str]:
    """(job id for humans, job key shared by every rank of this job and no other live job)."""
    jid = next((f"{k}={os.environ[k]}" for k in JOB_ENV if os.environ.get(k)), f"pid {os.getpid()}")
    key = "|".join([jid, os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")])
    return jid, key


@dataclass
class Holder:
    host: str
    pid: int
    pid_start: int | None
    boot_id: str
    launcher_pid: int  # the holder's parent (the launcher agent on its host)
    job_id: str
    job_key: str
    restart: int  # TORCHELASTIC_RESTART_COUNT: a restarted rank 0 takes over its predecessor's lease
    started: float
    refreshed: float

    @classmethod
    def me(cls) -> Holder:
        jid, key = _job()
        now = time.time()
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            pid_start=_proc_start(os.getpid()),
            boot_id=_boot_id(),
            launcher_pid=os.getppid(),
            job_id=jid,
            job_key=key,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            started=now,
            refreshed=now,
        )

    def describe(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid} ({self.job_id}, started {started})"

    def is_me(self) -> bool:
        return self.host == socket.gethostname() and self.pid == os.getpid() and self.boot_id == _boot_id()

    def dead(self, stale_s: float) -> str | None:
        """Why the holder is known to be gone (None: alive, or cannot tell yet)."""
        age = time.time() - self.refreshed
        if self.host != socket.gethostname():
            return f"not refreshed for {age:.0f} s (> checkpoint.lease_stale_s={stale_s:g})" if age > stale_s else None
        if self.boot_id and _boot_id() and self.boot_id != _boot_id():
            return "its host has rebooted since"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return f"pid {self.pid} is gone"
        except PermissionError:
            pass  # exists, owned by another user
        if _proc_stat(self.pid)[:1] in (["Z"], ["X"]):  # killed, not yet reaped: signal 0 still reaches it
            return f"pid {self.pid} is gone (exited, not yet reaped)"
        start = _proc_start(self.pid)
        if self.pid_start is not None and start is not None and start != self.pid_start:
            return f"pid {self.pid} now belongs to another process"
        return None


def _read(path: Path) -> Holder | None:
    try:
        return Holder(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # not ours / torn by hand: judged by its age alone
        try:
            age = time.time() - path.stat().st_mtime
        except FileNotFoundError:
            return None
        return Holder(
            "?", -1, None, "", -1, f"unreadable lease file {path}", "?", 0, time.time() - age, time.time() - age
        )


def _write(path: Path, h: Holder) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
    tmp.write_text(json.dumps(asdict(h)))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(d: Path):
    fd = lock_current(d / LOCK, 0o644, block=True)
    assert fd is not None  # blocking: never None
    try:
        yield
    finally:
        os.close(fd)


class Lease:
    """The lease rank 0 holds: refreshed by a daemon thread, released at exit."""

    def __init__(self, d: Path, me: Holder, stale_s: float, created_dir: bool) -> None:
        self.dir, self.me, self.stale_s, self.created_dir = d, me, stale_s, created_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="mbr-lease", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(max(0.2, self.stale_s / 4)):
            try:
                with _locked(self.dir):
                    if self._stop.is_set():  # released meanwhile
                        return
                    cur = _read(self.dir / LEASE)
                    if cur is not None and not cur.is_me():
                        print(
                            f"rank 0: the lease on checkpoint.dir={self.dir} was taken over by {cur.describe()}; "
                            "stopping so that one job writes the directory",
                            file=sys.stderr,
                            flush=True,
                        )
                        os._exit(1)
                    self.me.refreshed = time.time()
                    _write(self.dir / LEASE, self.me)
            except OSError as e:  # a filesystem hiccup: try again at the next period
                print(f"rank 0: could not refresh the lease on {self.dir}: {e}", file=sys.stderr, flush=True)

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            with _locked(self.dir):
                cur = _read(self.dir / LEASE)
                if cur is not None and cur.is_me():
                    (self.dir / LEASE).unlink()
                    (self.dir / LOCK).unlink()
        except OSError:
            return
        if self.created_dir:
            with contextlib.suppress(OSError):
                self.dir.rmdir()  # only if the job wrote nothing else


_HELD: dict[str, Lease] = {}


def _refusal(d: str, h: Holder, stale_s: float) -> str:
    return (
        f"checkpoint.dir={d} is in use by another training job ({h.describe()}); two jobs writing one "
        "checkpoint directory overwrite each other's checkpoints. Fix: let that job finish or stop it "
        f"(kill {h.pid} on {h.host}), or give this job its own checkpoint.dir=NEW_DIR (resume from that job's "
        "checkpoints with checkpoint.resume=true once it has ended). A lease whose holder died is taken over "
        f"by the next job: on {h.host} at once, from another host after checkpoint.lease_stale_s={stale_s:g} s "
        f"without refresh ({d}/{LEASE})."
    )


def _mine(h: Holder, me: Holder, rank: int) -> bool:
    """Whether a live lease belongs to this job (rank 0: this very process)."""
    if h.is_me():
        return True
    if rank == 0:  # a rank 0 restarted by an elastic agent succeeds its predecessor
        return h.job_key == me.job_key and h.restart < me.restart
    if h.host == me.host and h.launcher_pid == me.launcher_pid and h.boot_id == me.boot_id:
        return True  # rank 0 of this node's launcher
    # Another node's rank 0 (or another torchrun agent's on this host, e.g. two "nodes" on one
    # machine): the job key. torchrun's MASTER_PORT is its store's, unique among live jobs on a
    # host; the deepspeed launcher's is bound only later, so on one host only the launcher counts.
    return h.job_key == me.job_key and (h.host != me.host or bool(os.environ.get("TORCHELASTIC_RUN_ID")))


def acquire(cfg) -> Lease | None:
    """Take (global rank 0) or check (other ranks) the lease on `cfg.checkpoint.dir`; raises
    UserError when another live job holds it. Call before any process group exists."""
    ck = cfg.checkpoint
    if not ck.dir:
        return None
    d = Path(ck.dir).absolute()
    rank = int(os.environ.get("RANK", "0"))
    me = Holder.me()
    held = _read(d / LEASE)
    if held is not None and not _mine(held, me, rank) and held.dead(ck.lease_stale_s) is None:
        raise UserError(_refusal(ck.dir, held, ck.lease_stale_s))  # nothing written
    if rank != 0:
        return None
    if str(d) in _HELD and not _HELD[str(d)]._stop.is_set():
        return _HELD[str(d)]  # this process already holds it (several jobs in one launch)
    created = not d.exists()
    d.mkdir(parents=True, exist_ok=True)
    with _locked(d):
        held = _read(d / LEASE)  # again, under the lock: another job may have been faster
        if held is not None and not _mine(held, me, rank):
            why = held.dead(ck.lease_stale_s)
            if why is None:
                if created:  # leave nothing behind (a race: the other job made the directory too)
                    with contextlib.suppress(OSError):
                        d.rmdir()
                raise UserError(_refusal(ck.dir, held, ck.lease_stale_s))
            print(f"taking over the lease on checkpoint.dir={ck.dir} from {held.describe()}: {why}", flush=True)
        _write(d / LEASE, me)
    lease = _HELD[str(d)] = Lease(d, me, ck.lease_stale_s, created)
    return lease


__all__ = ["LEASE", "LOCK", "Holder", "Lease", "acquire"]
