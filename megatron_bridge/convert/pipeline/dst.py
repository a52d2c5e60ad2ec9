"""Whose is `dst`: one writer at a time, only our outputs replaced, partial leftovers swept.

A run writing `dst` holds a lease on it: an fcntl lock on `.<name>.mbr_lease` next to `dst`
(a sibling, since `dst` itself appears only at the final rename), held for the whole run and
released by the kernel when the process dies however it dies, so a dead writer's lease never
blocks anyone. The file names the holder (host, pid, command, start time: the fields of a
checkpoint directory's lease, train/lease.py), which a refused second run prints.

Under the lease, `.<name>.partial-*` and `.<name>.old-*` siblings can only be an interrupted
run's (its writer would hold the lease), so they are swept. An existing `dst` is replaced only
with `overwrite=true` and only when it is an output of ours — a converted checkpoint (its
`mbr_manifest.json`), an `mbr export` directory (its index says `written_by: mbr export`)
or an exported LoRA adapter (its two files alone);
a user's directory, or `dst=.` full of other files, is refused. The same check runs again
just before the final rename, so a directory created at `dst` during the run survives.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from megatron_bridge.bridge.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatron_bridge.convert.formats.manifest import MANIFEST
from megatron_bridge.convert.formats.safetensors_io import INDEX
from megatron_bridge.errors import UserError
from megatron_bridge.flock import lock_current

EXPORT_MARK = "mbr export"  # the `written_by` of an exported index's metadata
ADAPTER_FILES = {ADAPTER_CONFIG, ADAPTER_WEIGHTS}  # `mbr export adapter=true`


def lease_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.mbr_lease"


def is_ours(d: Path) -> bool:
    """Whether directory `d` holds an output of `mbr convert/reshard/export` (by its manifest)."""
    if (d / MANIFEST).is_file():
        return True
    with contextlib.suppress(OSError):
        if {p.name for p in d.iterdir()} == ADAPTER_FILES:
            return True
    try:
        meta = json.loads((d / INDEX).read_text()).get("metadata", {})
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(meta, dict) and meta.get("written_by") == EXPORT_MARK


def check_replaceable(dst: Path, overwrite: bool, arg: str = "dst") -> None:
    """UserError unless `dst` is absent, or `overwrite` and an output of ours."""
    if not os.path.lexists(dst):
        return
    if not overwrite:
        raise UserError(
            f"{arg}={dst} already exists; choose a new directory or pass overwrite=true "
            "(the old one is removed only after the new one is complete)"
        )
    if dst.is_symlink() or not dst.is_dir():
        raise UserError(f"{arg}={dst} exists and is not a directory; overwrite=true replaces only a directory we wrote")
    if not is_ours(dst):
        raise UserError(
            f"{arg}={dst} exists and is not an output of mbr convert/reshard/export (no {MANIFEST}, no index written "
            "by mbr export), so overwrite=true will not delete it: it may hold your files. Choose a new directory "
            f"(e.g. {arg}={dst}/out) or remove it yourself."
        )


def _holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv[:3])),
        "started": time.time(),
    }


def _describe(h: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h.get("started", 0))))
    return f"host {h.get('host', '?')}, pid {h.get('pid', '?')} ({h.get('command', '?')}, started {started})"


def _read(path: Path) -> dict:
    try:
        h = json.loads(path.read_text() or "{}")
        return h if isinstance(h, dict) else {}
    except (OSError, ValueError):
        return {}


@contextlib.contextmanager
def dst_lease(dst: Path, arg: str = "dst") -> Iterator[None]:
    """Hold the lease on `dst` for the block; UserError naming the holder when a live run holds it."""
    path = lease_path(dst)
    fd = lock_current(path, 0o666, block=False)
    if fd is None:
        raise UserError(
            f"{arg}={dst} is being written by another run ({_describe(_read(path))}); two runs writing one "
            f"directory would destroy each other's output. Fix: let that run finish or stop it, or choose "
            f"another {arg}. (Its lease, {path}, is released when that process ends, however it ends.)"
        )
    try:
        # written, then cut to its length: a truncate to 0 makes ext4 flush the file when it is
        # closed (auto_da_alloc), and that close then waited 1-2 s for the journal, which is
        # busy committing the output (docs/benchmarks.md, "After the copies")
        data = json.dumps(_holder()).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        sweep_partials(dst)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
        os.close(fd)


def sweep_partials(dst: Path) -> list[Path]:
    """Remove interrupted runs' temporaries of `dst` (call with the lease held: no live writer owns them)."""
    gone = []
    with contextlib.suppress(FileNotFoundError):
        for p in dst.parent.iterdir():
            if p.name.startswith((f".{dst.name}.partial-", f".{dst.name}.old-")) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p)
    if gone:
        print(f"removed {len(gone)} leftover partial output(s) of {dst} from interrupted runs", flush=True)
    return gone


def publish_mode(d: Path) -> None:
    """mkdtemp makes 0700: give the output directory the mode mkdir would (umask honoured)."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(d, 0o777 & ~mask)


__all__ = ["check_replaceable", "dst_lease", "is_ours", "lease_path", "publish_mode", "sweep_partials"]
