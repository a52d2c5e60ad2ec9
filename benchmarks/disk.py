"""Disk helpers shared by the conversion benchmarks (no torch: the fp8 benchmark stays light).

`evict` drops a directory's files from the page cache, so the next command reads from disk
as a real conversion of a model bigger than RAM would; `cp_seconds` times `cp -r` the same
way, so every ratio compares two runs made under the same machine load.
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


def cp_seconds(src: Path, dst: Path, warm: bool = False) -> float:
    """`cp -r src dst` (input evicted unless `warm`) until its data is on disk (a final sync);
    dst removed afterwards."""
    shutil.rmtree(dst, ignore_errors=True)
    if not warm:
        evict(src)
    subprocess.run(["sync"], check=True)
    t = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - t
    shutil.rmtree(dst)
    return seconds
