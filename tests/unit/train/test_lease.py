"""The checkpoint-directory lease (train/lease.py), in one process against real processes:
a live holder (a `sleep` subprocess) refuses us without anything written, a dead one, a reused
pid, a stale foreign host are taken over, ranks > 0 accept their own job's lease, rank 0
refreshes it and removes it (and the directory it created) when released."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from megatron_bridge.errors import UserError
from megatron_bridge.train import lease as L


def cfg(d, stale=60.0):
    return SimpleNamespace(checkpoint=SimpleNamespace(dir=str(d), lease_stale_s=stale))


@pytest.fixture(autouse=True)
def isolated(monkeypatch):
    for k in ("RANK", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    yield
    for lease in list(L._HELD.values()):
        lease.release()
    L._HELD.clear()


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def plant(d, **kw) -> L.Holder:
    """Write a lease as another process would have."""
    kw = {"launcher_pid": -7, "job_id": "SLURM_JOB_ID=42", "job_key": "42||", **kw}
    h = dataclasses.replace(L.Holder.me(), **kw)
    d.mkdir(parents=True, exist_ok=True)
    (d / L.LEASE).write_text(json.dumps(dataclasses.asdict(h)))
    return h


def listing(d):
    return {p.name: p.stat().st_mtime_ns for p in d.iterdir()}


def test_free_directory_is_leased_then_released(tmp_path):
    d = tmp_path / "ck"
    lease = L.acquire(cfg(d))
    held = json.loads((d / L.LEASE).read_text())
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    assert L.acquire(cfg(d)) is lease  # several jobs of one process: the same lease
    lease.release()
    assert not d.exists()  # it created the directory and wrote nothing else


def test_live_holder_refuses_and_nothing_is_written(tmp_path, sleeper):
    d = tmp_path / "ck"
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid))
    before = listing(d)
    for rank in ("0", "1"):
        os.environ["RANK"] = rank
        with pytest.raises(UserError) as e:
            L.acquire(cfg(d))
        msg = str(e.value)
        assert f"pid {sleeper.pid}" in msg and "SLURM_JOB_ID=42" in msg and socket.gethostname() in msg
        assert "checkpoint.dir=NEW_DIR" in msg and f"kill {sleeper.pid}" in msg
    assert listing(d) == before


def test_dead_holder_is_taken_over(tmp_path, sleeper, capsys):
    d = tmp_path / "ck"
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid))
    sleeper.kill()
    sleeper.wait()
    L.acquire(cfg(d))
    assert f"pid {sleeper.pid} is gone" in capsys.readouterr().out
    assert json.loads((d / L.LEASE).read_text())["pid"] == os.getpid()


def test_killed_but_unreaped_holder_is_gone(tmp_path, sleeper, capsys):
    """A holder killed -9 whose parent has not reaped it yet (a zombie) still answers signal 0:
    it is gone all the same (the crash suite's resume raced one)."""
    d = tmp_path / "ck"
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid))
    sleeper.kill()
    for _ in range(200):  # until the kernel shows it as a zombie (we do not wait() for it)
        if L._proc_stat(sleeper.pid)[:1] == ["Z"]:
            break
        time.sleep(0.01)
    os.kill(sleeper.pid, 0)  # still "exists"
    L.acquire(cfg(d))
    assert f"pid {sleeper.pid} is gone (exited, not yet reaped)" in capsys.readouterr().out
    sleeper.wait()


def test_reused_pid_is_not_the_holder(tmp_path, sleeper, capsys):
    d = tmp_path / "ck"
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid) - 1)  # an older process had that pid
    L.acquire(cfg(d))
    assert "now belongs to another process" in capsys.readouterr().out


def test_other_host_is_live_until_stale(tmp_path, capsys):
    d = tmp_path / "ck"
    plant(d, host="other-node", pid=12345, refreshed=time.time() - 5)
    with pytest.raises(UserError, match="host other-node, pid 12345"):
        L.acquire(cfg(d, stale=60))
    plant(d, host="other-node", pid=12345, refreshed=time.time() - 61)
    L.acquire(cfg(d, stale=60))
    assert "not refreshed for 61 s (> checkpoint.lease_stale_s=60)" in capsys.readouterr().out


def test_other_ranks_accept_their_own_jobs_lease(tmp_path, sleeper, monkeypatch):
    d = tmp_path / "ck"
    monkeypatch.setenv("RANK", "1")
    # rank 0 of this job: same launcher (our parent) on this host
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid), launcher_pid=os.getppid())
    before = listing(d)
    assert L.acquire(cfg(d)) is None and listing(d) == before
    # rank 0 of this job on another node: same job key
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    monkeypatch.setenv("MASTER_PORT", "29999")
    plant(d, host="node0", pid=1, job_key=L._job()[1], refreshed=time.time())
    assert L.acquire(cfg(d)) is None
    plant(d, host="node0", pid=1, job_key="other", refreshed=time.time())
    with pytest.raises(UserError):
        L.acquire(cfg(d))
    # another torchrun agent of this job on this host (two "nodes" on one machine)
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid), job_key=L._job()[1])
    assert L.acquire(cfg(d)) is None
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # deepspeed launcher: the same key proves nothing here
    plant(d, pid=sleeper.pid, pid_start=L._proc_start(sleeper.pid), job_key=L._job()[1])
    with pytest.raises(UserError):
        L.acquire(cfg(d))


def test_rank0_refreshes_and_stops_when_taken_over(tmp_path):
    d = tmp_path / "ck"
    L.acquire(cfg(d, stale=0.4))
    first = json.loads((d / L.LEASE).read_text())["refreshed"]
    for _ in range(100):
        time.sleep(0.05)
        if json.loads((d / L.LEASE).read_text())["refreshed"] > first:
            break
    assert json.loads((d / L.LEASE).read_text())["refreshed"] > first


def test_refresh_exits_when_the_lease_was_taken(tmp_path):
    """Run in a child: its refresh thread finds another holder's name and ends the process."""
    d = tmp_path / "ck"
    code = (
        "import json, time, types, sys; from megatron_bridge.train import lease as L\n"
        f"c = types.SimpleNamespace(checkpoint=types.SimpleNamespace(dir={str(d)!r}, lease_stale_s=0.4))\n"
        "L.acquire(c); h = json.loads(open(L.Path(c.checkpoint.dir) / L.LEASE).read())\n"
        "h['pid'] = 1; open(L.Path(c.checkpoint.dir) / L.LEASE, 'w').write(json.dumps(h))\n"
        "time.sleep(30); sys.exit(5)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "was taken over by host" in p.stderr and "pid 1 " in p.stderr
