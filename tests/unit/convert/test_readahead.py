"""Read-ahead (`convert/formats/readahead.py`, `command.read_ahead_source`): a range is
advised in chunks the kernel does not cap, so all of it reaches the page cache, and the
start-up read-ahead runs in a child that the command reaps."""

import ctypes
import mmap
import os
import time

import pytest

from megatron_bridge.convert import command
from megatron_bridge.convert.formats import readahead

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise")


def test_a_range_is_advised_in_window_chunks(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(readahead, "window", lambda dev: 1000)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, at, n, advice: calls.append((at, n, advice)))
    with open(tmp_path / "f", "wb") as f:
        readahead.will_need(f.fileno(), 123, 4500)
        readahead.will_need(f.fileno(), 0, 0)
    assert [(at, n) for at, n, _ in calls] == [(123, 1000), (1123, 1000), (2123, 1000), (3123, 1000), (4123, 500)]
    assert {a for *_, a in calls} == {os.POSIX_FADV_WILLNEED}


def test_window_reads_the_device_limits_or_falls_back(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    assert readahead.window(os.stat(tmp_path / "f").st_dev) >= 4096
    assert readahead.window(os.makedev(4095, 4095)) == readahead.FALLBACK_WINDOW  # no such device in sysfs


def _resident(path) -> float:
    """Fraction of `path`'s pages in the page cache (mincore on a shared read-only map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = (ctypes.c_ubyte * pages)()
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages


def test_the_whole_file_reaches_the_page_cache(tmp_path):
    """The bug this module fixes: one WILLNEED call per file read only its first window."""
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(os.urandom(2**20) * 32)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _resident(path) > 0.5:
        pytest.skip(f"{tmp_path}'s filesystem keeps files in memory (tmpfs?): nothing to read ahead")
    readahead.read_ahead_files([path], budget=2**40)
    deadline = time.monotonic() + 20
    while _resident(path) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _resident(path) == 1.0


def test_the_start_up_read_ahead_runs_in_a_child_the_command_reaps(monkeypatch, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 4096)
    monkeypatch.setattr(command, "_may_fork", lambda: False)
    assert command.read_ahead_source([f"src={tmp_path}"])() is None  # in-process: nothing started
    monkeypatch.setattr(command, "_may_fork", lambda: True)
    forks, fork = [], os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or fork())
    assert command.read_ahead_source(["src=/no/such/dir"])() is None and not forks
    stop = command.read_ahead_source([f"src={tmp_path}", "dst=/x"])
    assert len(forks) == 1
    time.sleep(0.2)
    stop()
    with pytest.raises(ChildProcessError):  # reaped: no child left behind
        os.waitpid(-1, os.WNOHANG)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_rolling_read_ahead_stays_its_bound_ahead_and_skips_repeats(monkeypatch, tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0" * 1000)
    announced = []
    monkeypatch.setattr(readahead, "will_need", lambda fd, start, n: announced.append((start, n)))
    ahead = readahead.RollingReadAhead(ahead=150)
    try:
        assert ahead.want([(f, 0, 100)]) == 100
        assert ahead.want([(f, 0, 100), (f, 100, 100)]) == 100  # the repeat is not announced again
        assert ahead.want([(f, 200, 100), (f, 300, 0)]) == 100
        assert _wait_for(lambda: announced == [(0, 100), (100, 100)])
        time.sleep(0.2)
        assert announced == [(0, 100), (100, 100)]  # 200 announced, none started: past the bound
        ahead.started(100)
        assert _wait_for(lambda: announced == [(0, 100), (100, 100), (200, 100)])
        ahead.want([(f, 400, 100)])
    finally:
        ahead.close()  # returns with a range still queued
    assert not ahead._thread.is_alive()


def test_the_pool_announces_what_its_tasks_read(monkeypatch, tmp_path):
    from megatron_bridge.convert.bytemove.pool import WorkerPool

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\0" * 4096)
    announced = []
    monkeypatch.setattr(readahead, "will_need", lambda fd, start, n: announced.append((start, n)))

    class State:
        def close(self) -> None:
            pass

    ran: list[str] = []
    for workers in (1, 2):
        announced.clear()
        ran.clear()
        pool = WorkerPool(workers, State)
        try:
            pool.submit("a", lambda s: ran.append("a"), 10, reads=[(f, 0, 1024)])
            pool.submit("b", lambda s: ran.append("b"), 10, reads=[(f, 1024, 2048), (f, 0, 1024)])
            pool.drain()
            assert _wait_for(lambda: announced == [(0, 1024), (1024, 2048)])
        finally:
            pool.close()
        assert sorted(ran) == ["a", "b"]


def test_pieces_name_the_file_ranges_they_read():
    from pathlib import Path

    from megatron_bridge.convert.bytemove.pieces import Band, Interleave, Span, Zeros, reads
    from megatron_bridge.convert.bytemove.strided import Gather, Mem, Scatter

    a, b = Path("a"), Path("b")
    ps = [
        Span(a, 10, 100),
        Span(Mem(bytearray(8)), 0, 8),  # memory: nothing read
        Zeros(64),
        Band(a, 200, 4, 32, 8, 16),  # the band's whole rows are read
        Interleave(3, ((a, 1000, 10), (b, 0, 20)), ((0, 5), (0, 20))),
        Gather(b, 500, (6, 4), 2, (0, 6, 2), (0, 4), False),
        Scatter((2, 8), 2, ((a, 0, (0, 2, 1), (0, 4), False), (b, 64, (0, 2, 1), (4, 8), False))),
    ]
    assert reads(ps) == [(a, 10, 100), (a, 200, 128), (a, 1000, 30), (b, 0, 60), (b, 500, 48), (a, 0, 16), (b, 64, 16)]
