"""The byte-move worker pool (convert/bytemove/pool.py): routing, order, failures, bounds."""

from __future__ import annotations

import threading
import time

import pytest

from megatron_bridge.convert.bytemove import pool as pool_mod
from megatron_bridge.convert.bytemove.pool import WorkerPool, resolve_workers


class Log(list):
    """A worker state: what ran on it, and whether the pool closed it."""

    closed = False

    def close(self) -> None:
        self.closed = True


def test_a_keys_tasks_run_on_one_worker_in_order():
    p = WorkerPool(3, Log)
    for i in range(40):
        p.submit(i // 4, lambda state, i=i: (time.sleep(0.001 * (i % 3)), state.append(i)), nbytes=1 + i % 5)
    p.drain()
    p.close()
    seen = [x for state in p.states for x in state]
    assert sorted(seen) == list(range(40))
    for state in p.states:  # every key's 4 tasks: one worker, in submission order
        for key in {i // 4 for i in state}:
            assert [i for i in state if i // 4 == key] == [4 * key + j for j in range(4)]
    assert sum(1 for state in p.states if state) > 1  # the keys were spread
    assert all(state.closed for state in p.states)  # close() closes every worker's state


def test_one_worker_runs_in_the_callers_thread():
    p = WorkerPool(1, Log)
    p.submit("a", lambda state: state.append(threading.current_thread()))
    assert p.states[0] == [threading.current_thread()]


def test_a_failure_is_raised_to_the_caller():
    """By the next submit that finds it finished, or by drain: the conversion stops there."""
    p = WorkerPool(2, Log)

    def boom(state):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        p.submit("a", boom)
        for k in range(100):
            time.sleep(0.001)
            p.submit(k, lambda state: None)
        p.drain()
    p.close()


def test_the_caller_waits_when_too_much_is_queued(monkeypatch):
    monkeypatch.setattr(pool_mod, "QUEUED_PER_WORKER", 2)
    gate, running = threading.Event(), []
    p = WorkerPool(2, Log)
    for i in range(4):  # fills the queue: 2 per worker
        p.submit(i, lambda state, i=i: (running.append(i), gate.wait()))
    t = threading.Thread(target=p.submit, args=(9, lambda state: None))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # blocked until a task ends
    gate.set()
    t.join(5)
    assert not t.is_alive()
    p.drain()
    p.close()


def test_zero_means_one_per_core():
    assert resolve_workers(0) == pool_mod.default_workers() >= 2
    assert resolve_workers(5) == 5


def test_a_lane_names_the_worker():
    """A task with `lane` runs on worker `lane % workers`, whatever its key or the queue."""
    p = WorkerPool(2, Log)
    for i in range(12):
        p.submit(i, lambda state, i=i: state.append(i), nbytes=100 if i % 4 else 1, lane=i % 3)
    p.drain()
    p.close()
    assert p.states[0] == [i for i in range(12) if i % 3 in (0, 2)]
    assert p.states[1] == [i for i in range(12) if i % 3 == 1]
