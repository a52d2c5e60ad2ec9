"""One fcntl lock on a lock file that its holder deletes on release: `lock_current`.

Both leases (a checkpoint directory's, train/lease.py, and an output `dst`'s,
convert/pipeline/dst.py) delete their lock file when they let go, so a process that opened the
file just before the unlink can lock an inode nobody else will ever open again — and two
processes would both "hold" it. The cure is to re-check, once locked, that the path still
names the inode we locked, and to start over otherwise; this is that loop, in one place.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


def lock_current(path: Path, mode: int, *, block: bool) -> int | None:
    """An fd holding an exclusive lock on the file `path` names now (created with `mode` if
    missing). With `block=False`, None when another process holds it; the caller closes the fd."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            if block:
                raise
            return None
        try:  # the file may have been removed by a releasing holder between our open and lock
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
