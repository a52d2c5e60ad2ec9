"""Training checkpoints: per-rank state, written atomically, verified on load.

Layout (Megatron's names where Megatron has them):

    DIR/latest_checkpointed_iteration.txt      written last, by rename: the only pointer
    DIR/iter_0000010/rank_00003.pt             one file per rank: model shard, optimizer,
                                               scheduler, RNG states, data position
    DIR/iter_0000010/manifest.json             layout, iteration, sha256 of every rank file

Every rank writes into `iter_N.tmp/` (file by file through `*.partial` + rename); after a
barrier rank 0 writes the manifest with the gathered checksums, renames the directory to
`iter_N`, then replaces the `latest` pointer. A job killed at any point leaves either the
previous complete checkpoint as `latest` or the new one — never a torn one; leftover
`.tmp` directories are ignored and removed by the next save. With `checkpoint.async_save`
the rank files are written by a background thread after the state is serialised, and the
same publication happens at a later step boundary, once every rank's write is done. `verify()` re-hashes the files
(`mbr check-ckpt` runs it from the command line); `peek()` reads the pointer and the manifest
without hashing (the trainer's preflight); both live in the torch-free `manifest.py`. A rank
file is loaded as data only (`runtime/safe_load.torch_load`: weights_only plus the NumPy RNG
state's names), never with `weights_only=False`. Test-only fault injection (`MBR_FAULT`, see
megatron_bridge/reliability.py) can SIGKILL a process at three points of `save`: after its
file is written, after the manifest, after the rename — tests/reliability kills at each.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron_bridge.convert.formats.pickle_guard import TRAINING
from megatron_bridge.errors import UserError
from megatron_bridge.reliability import fault
from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.runtime.safe_load import torch_load
from megatron_bridge.train.host_staging import HostStaging, host_snapshot
from megatron_bridge.train.manifest import (
    LATEST,
    MANIFEST,
    atomic_write_bytes,
    check_meta,
    iter_dir,
    latest_iteration,
    peek,
    verify,
)


def _dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


@contextmanager
def _no_space(root: Path, tmp: Path, iteration: int) -> Iterator[None]:
    """A full disk (ENOSPC, EDQUOT) mid-save: the unpublished directory is removed, the previous
    checkpoint and `latest` stay as they were (nothing is published before the last write), and
    the user is told where and what to do instead of seeing an OSError traceback."""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        prev = latest_iteration(root)
        kept = "no earlier checkpoint exists" if prev is None else f"iteration {prev} and {root / LATEST} are intact"
        raise UserError(
            f"disk full while saving the checkpoint of iteration {iteration} to {tmp} ({e.strerror}): none of "
            f"it was published and its partial files are removed; {kept}. Free space on the filesystem of "
            f"{root} (or set checkpoint.dir to one with room), then resume with checkpoint.resume=true."
        ) from e


def save(
    root: str | Path,
    iteration: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: `start` and `finish` at once; returns the published directory."""
    return start(root, iteration, state, meta, extra).finish()


def start(
    root: str | Path,
    iteration: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    extra: Callable[[Path], None] | None = None,
    *,
    background: bool = False,
    staging: HostStaging | None = None,
) -> Pending:
    """Collective: every rank calls it with its own `state`. `extra(tmp_dir)`, when given, is
    called on every rank to write engine-owned files (DeepSpeed's ZeRO partitions, a LoRA
    adapter) into the same not-yet-published directory; rank 0 checksums those too.

    With `background` the calling thread takes only the snapshot (`host_snapshot`: every tensor
    copied to host memory no step touches; into `staging`'s reused, on a GPU pinned, buffers
    when given), and a thread serialises it into the rank file,
    hashing and fsyncing it while training goes on; on a GPU, serialising in the step cost more
    than the device-to-host copy by ~10x (docs/benchmarks.md, "Async checkpoint save"). The returned `Pending`
    publishes the directory when every rank's write is done (`Pending.written_everywhere`,
    `Pending.finish`: collectives, called from the training loop at step boundaries);
    otherwise `finish` only publishes what is already written."""
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    root = Path(root)
    tmp = iter_dir(root, iteration).with_suffix(".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("iter_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    if dist:
        dist.barrier()
    data = host_snapshot(state, staging) if background else state
    if extra is not None:
        with _no_space(root, tmp, iteration):
            extra(tmp)
    return Pending(root, iteration, meta, f"rank_{rank:05d}.pt", data, background)


def write_state(path: Path, state: Any) -> dict[str, Any]:
    """torch.save streamed into `path.partial` (hashed as it goes, no copy of the bytes in
    memory), fsynced, renamed to `path`; returns the manifest's sha256 and bytes."""
    part = path.with_name(path.name + ".partial")
    with open(part, "wb") as f:
        out = _HashingWriter(f)
        torch.save(state, cast(IO[bytes], out))  # torch.save calls only write (and flush)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)
    return {"sha256": out.sha.hexdigest(), "bytes": out.bytes}


class _HashingWriter:
    """A write-only file for torch.save that hashes and counts what passes to the file."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.bytes = f, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        self.sha.update(b)
        self.bytes += len(memoryview(b))
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()


class Pending:
    """One rank's part of a checkpoint between its snapshot and its publication."""

    def __init__(self, root: Path, iteration: int, meta: dict[str, Any], name: str, data: Any, background: bool):
        self.root, self.iteration, self.meta = root, iteration, meta
        self.tmp = iter_dir(root, iteration).with_suffix(".tmp")
        self._entry: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if background:  # a daemon: a job that dies mid-write leaves an unpublished `.tmp`, never `latest`
            self._thread = threading.Thread(target=self._write, args=(name, data), name="mbr-ckpt-write", daemon=True)
            self._thread.start()
        else:
            self._write(name, data)

    def _write(self, name: str, state: Any) -> None:
        try:
            with _no_space(self.root, self.tmp, self.iteration):
                self._entry = {"file": name, **write_state(self.tmp / name, state)}
            fault("ckpt_write", self.iteration)  # test-only fault injection (MBR_FAULT); a no-op otherwise
        except BaseException as e:  # reported by finish() on every rank, not lost in the thread
            self._error = e

    def written_everywhere(self) -> bool:
        """Collective (one scalar all-reduce): has every rank's write finished?"""
        done = self._thread is None or not self._thread.is_alive()
        dist = _dist()
        if dist is None:
            return done
        flag = torch.tensor([1.0 if done else 0.0], device=comm_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def finish(self) -> Path:
        """Collective: wait for this rank's write, then rank 0 writes the manifest with every
        rank's checksum, renames `iter_N.tmp` to `iter_N` and replaces `latest`. A rank whose
        write failed makes every rank raise (naming it), and nothing is published."""
        if self._thread is not None:
            self._thread.join()
        dist = _dist()
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
        mine = self._entry if self._error is None else {"error": f"{type(self._error).__name__}: {self._error}"}
        entries: list[dict[str, Any]] = [{} for _ in range(world)]
        if dist:
            dist.all_gather_object(entries, mine)
        else:
            entries = [mine]
        failed = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if "error" in e]
        if isinstance(self._error, UserError):  # this rank's own disk full: its message, every rank stops
            raise self._error
        if failed:
            raise RuntimeError(f"checkpoint iteration {self.iteration} was not written: " + "; ".join(failed))
        final, tmp = iter_dir(self.root, self.iteration), self.tmp
        if rank == 0:
            known = {e["file"] for e in entries} | {MANIFEST}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                rel = str(f.relative_to(tmp))
                if rel not in known:
                    data_f = f.read_bytes()
                    entries.append({"file": rel, "sha256": hashlib.sha256(data_f).hexdigest(), "bytes": len(data_f)})
            manifest = {"iteration": self.iteration, "world_size": world, "files": entries, **self.meta}
            with _no_space(self.root, tmp, self.iteration):
                atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
            fault("ckpt_publish", self.iteration)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fault("ckpt_latest", self.iteration)
            atomic_write_bytes(self.root / LATEST, f"{self.iteration}\n".encode())
        if dist:
            dist.barrier()
        return final


def load(root: str | Path, meta_must_match: dict[str, Any]) -> tuple[int, dict[str, Any]] | tuple[None, None]:
    """Load this rank's state from the latest complete checkpoint, or (None, None).
    `meta_must_match` (e.g. the layout) must equal the manifest's values: resuming a per-rank
    checkpoint under another layout would silently load the wrong shards."""
    it, _ = peek(root)
    if it is None:
        return None, None
    d = iter_dir(root, it)
    manifest = verify(d)
    check_meta(d, manifest, meta_must_match)
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    state = torch_load(d / f"rank_{rank:05d}.pt", TRAINING, map_location="cpu")  # data only: never code
    state["_dir"] = str(d)
    return it, state


def rng_state() -> dict[str, Any]:
    """Every generator a training step draws from (torch, numpy, python, megatron's tracker):
    saved with each rank's state so that a resumed run draws what the uninterrupted one did."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(s: dict[str, Any]) -> None:
    """Put back what `rng_state()` returned."""
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])


__all__ = ["load", "rng_state", "save", "set_rng_state"]
