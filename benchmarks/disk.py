"""Disk helpers shared by the conversion benchmarks (no torch: the fp8 benchmark stays light).

`evict` drops a directory's files from the page cache, so the next command reads from disk
as a real conversion of a model bigger than RAM would; `settle` syncs and pauses before a
timed run; `cp_seconds` times `cp -r` the same way, so every ratio compares two runs made
under the same machine load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path


def evict(directory: Path) -> None:
    """Drop `directory`'s files from the page cache (after a sync, so they are clean).
    Affects only these files; needs no privileges."""
    subprocess.run(["sync"], check=True)
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


SETTLE_SECONDS = 3.0  # the pause before every timed run (benchmarks' --settle)


def settle(seconds: float = SETTLE_SECONDS) -> None:
    """`sync`, then wait: a timed run starts on a quiet disk. Deleting the previous run's
    1.7 GB output just before one (ext4 mounted with `discard` on the project's VM) moved
    single runs by seconds — every `cp` right after an export's input was written and the
    previous output deleted took 6.1-7.7 s against 4.1-5.0 s elsewhere (docs/benchmarks.md)."""
    subprocess.run(["sync"], check=True)
    time.sleep(seconds)


def cp_seconds(src: Path, dst: Path, warm: bool = False) -> float:
    """`cp -r src dst` (input evicted unless `warm`) until its data is on disk (a final sync);
    dst removed afterwards."""
    shutil.rmtree(dst, ignore_errors=True)
    if not warm:
        evict(src)
    settle()
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - t
    shutil.rmtree(dst)
    return seconds
