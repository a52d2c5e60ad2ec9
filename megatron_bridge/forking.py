"""How many threads this process runs — the one test for "may this process fork?".

A fork copies only the calling thread; a lock another thread holds stays held in the child
forever. Python's `threading.active_count()` misses native threads (an OpenBLAS pool, a
library's background thread), so on Linux the kernel's list is counted instead. Used by the
launcher that forks ranks (fork_launch.py, fork_server.py) and by the conversion commands'
start-up children (convert/command.py).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

# Threads that may run while forking: jemalloc's background thread (pyarrow's allocator, which
# deepspeed's import loads) — jemalloc takes and releases its locks around fork (pthread_atfork).
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)


def thread_names() -> list[str] | None:
    """The kernel's names of this process's threads (Linux /proc; None where there is none); a
    thread that ends while they are read is left out."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    names = []
    for t in tids:
        try:
            names.append(Path(f"/proc/self/task/{t}/comm").read_text().strip())
        except OSError:  # it ended meanwhile
            pass
    return names


def threads() -> int:
    """This process's threads, other than FORK_SAFE_THREADS (Linux /proc; elsewhere Python's)."""
    names = thread_names()
    if names is None:
        return threading.active_count()
    return sum(name not in FORK_SAFE_THREADS for name in names)


__all__ = ["FORK_SAFE_THREADS", "thread_names", "threads"]
