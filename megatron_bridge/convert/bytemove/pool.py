"""The byte-move drivers' worker pool: `workers=` threads, each with its own `Copier`.

Why threads: every heavy step of a byte move releases the GIL — `copy_file_range`,
`preadv`/`pwritev`, zlib-ng's CRC-32 and numpy's fp8 gather (formats/fp8.py) — so threads
overlap one tensor's disk wait with another's copy and spread the fp8 arithmetic over the
cores, without pickling anything between processes. Output offsets are reserved by the
caller, in order, before a task is queued, so files are byte-identical whatever the number
of workers or the order the tasks finish in.

Tasks with the same key (a table row: its TP/EP shards) run on the same worker, one after
another: a band region read for one shard serves the next, and a row's dequantised fp8
tensors live on one worker only — so memory stays `workers ×` one row's buffers. A new key
goes to the worker with the fewest bytes queued — unless the caller names a `lane` (its
output file's index: dist_ckpt.DistWriter's files), then to worker `lane % workers`, so no
two workers write into one file at once (they would contend for its inode). The caller blocks while more than
`QUEUED_PER_WORKER` tasks per worker are queued (progress stays honest, descriptors
bounded). `workers=1` runs every task in the caller's thread (the serial path).

A task names the file ranges it reads (`reads=`): they are announced to the kernel ahead of
the workers (formats/readahead.py `RollingReadAhead`), so the disk reads at its queue depth
instead of one sequential read-ahead window per copy.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from megatron_bridge.convert.formats.readahead import RollingReadAhead


class State(Protocol):
    def close(self) -> None: ...


W = TypeVar("W", bound=State)  # a worker's own state (its copier, buffers), closed with the pool

QUEUED_PER_WORKER = 8


def usable_cores() -> int:
    """The cores this process may run on: an affinity limit, not the host's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_workers() -> int:
    """`usable_cores()`, at least 2: even on one core a second thread works in user space
    (bands, fp8) while the other waits on the disk or copies in the kernel — what the byte
    paths did before the pool."""
    return max(2, usable_cores())


def resolve_workers(workers: int) -> int:
    """`workers=0` means one per core; a negative count is refused by the config check."""
    return workers if workers > 0 else default_workers()


class WorkerPool(Generic[W]):
    """`submit(key, fn, nbytes, reads=)` runs `fn(state)` on a worker (see module doc);
    `drain()` waits for everything queued and re-raises the first failure."""

    def __init__(self, workers: int, make_state: Callable[[], W], name: str = "mbr-move"):
        self.workers = resolve_workers(workers)
        self.states = [make_state() for _ in range(self.workers)]
        n = self.workers if self.workers > 1 else 0
        self._ex = [ThreadPoolExecutor(1, thread_name_prefix=f"{name}-{i}") for i in range(n)]
        self._queued = [0] * self.workers  # bytes queued per worker
        self._lock = threading.Lock()
        self._pending: deque[Future] = deque()
        self._last: tuple[Hashable, int] | None = None
        self._ahead = RollingReadAhead()

    def submit(
        self,
        key: Hashable,
        fn: Callable[[W], object],
        nbytes: int = 0,
        lane: int | None = None,
        reads: Iterable[tuple[Path, int, int]] = (),
    ) -> None:
        announced = self._ahead.want(reads)
        if not self._ex:
            self._ahead.started(announced)
            fn(self.states[0])
            return
        if lane is not None:
            k = lane % self.workers
        elif self._last is not None and self._last[0] == key:
            k = self._last[1]
        else:
            with self._lock:
                k = min(range(self.workers), key=self._queued.__getitem__)
        self._last = (key, k)
        with self._lock:
            self._queued[k] += nbytes

        def run() -> None:
            self._ahead.started(announced)
            try:
                fn(self.states[k])
            finally:
                with self._lock:
                    self._queued[k] -= nbytes

        self._pending.append(self._ex[k].submit(run))
        while len(self._pending) > QUEUED_PER_WORKER * self.workers:
            self._pending.popleft().result()
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        """Stop: queued tasks are cancelled, running ones finish (their files are still open),
        then every worker's state is closed."""
        for ex in self._ex:
            ex.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._ahead.close()
        for state in self.states:
            state.close()


__all__ = ["QUEUED_PER_WORKER", "WorkerPool", "default_workers", "resolve_workers"]
