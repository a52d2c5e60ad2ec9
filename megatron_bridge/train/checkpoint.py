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
`.tmp` directories are ignored and removed by the next save. `verify()` re-hashes the files
(`mbr check-ckpt` runs it from the command line); `peek()` reads the pointer and the manifest
without hashing (the trainer's preflight). Test-only fault injection (`MBR_FAULT`, see
megatron_bridge/reliability.py) can SIGKILL a process at three points of `save`: after its
file is written, after the manifest, after the rename — tests/reliability kills at each.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_bridge.errors import UserError
from megatron_bridge.reliability import fault

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _dist():
    import torch  # imported here: verify/peek (mbr check-ckpt, the trainer's preflight) need no torch

    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def save(
    root: str | Path,
    iteration: int,
    state: dict[str, Any],
    meta: dict[str, Any],
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank calls it with its own `state`. `extra(tmp_dir)`, when given, is
    called on every rank to write engine-owned files (DeepSpeed's ZeRO partitions) into the
    same not-yet-published directory; rank 0 checksums those too. Returns the final directory."""
    import torch

    dist = _dist()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)
    root = Path(root)
    final, tmp = iter_dir(root, iteration), iter_dir(root, iteration).with_suffix(".tmp")
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("iter_*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    if dist:
        dist.barrier()
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    name = f"rank_{rank:05d}.pt"
    _atomic_write_bytes(tmp / name, data)
    entry = {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if extra is not None:
        extra(tmp)
    fault("ckpt_write", iteration)  # test-only fault injection (MBR_FAULT); a no-op otherwise
    entries: list[dict[str, Any]] = [{} for _ in range(world)]
    if dist:
        dist.all_gather_object(entries, entry)
    else:
        entries = [entry]
    if rank == 0:
        known = {e["file"] for e in entries} | {MANIFEST}
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            rel = str(f.relative_to(tmp))
            if rel not in known:
                data_f = f.read_bytes()
                entries.append({"file": rel, "sha256": hashlib.sha256(data_f).hexdigest(), "bytes": len(data_f)})
        manifest = {"iteration": iteration, "world_size": world, "files": entries, **meta}
        _atomic_write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        fault("ckpt_publish", iteration)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fault("ckpt_latest", iteration)
        _atomic_write_bytes(root / LATEST, f"{iteration}\n".encode())
    if dist:
        dist.barrier()
    return final


def latest_iteration(root: str | Path) -> int | None:
    """Iteration named by the `latest` pointer, or None when there is no checkpoint."""
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    text = p.read_text().strip()
    if not text.isdigit():
        raise UserError(f"{p} is corrupt (content {text!r}); delete it to restart, or restore the file.")
    return int(text)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory, checked for shape (not hashed); UserError if absent
    or unreadable."""
    d = Path(directory)
    mf = d / MANIFEST
    if not d.is_dir():
        raise UserError(f"checkpoint directory {d} does not exist.")
    if not mf.is_file():
        raise UserError(f"{d} has no {MANIFEST}: it is not a complete checkpoint (an interrupted save?).")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{mf} is corrupt ({e}). Resume from an earlier iteration (edit {LATEST}) or re-create the checkpoint."
        ) from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, list) or not all(isinstance(e, dict) and {"file", "sha256"} <= e.keys() for e in files):
        raise UserError(
            f"{mf} is malformed (no list of files with sha256 checksums). Resume from an earlier "
            f"iteration (edit {LATEST}) or re-create the checkpoint."
        )
    return manifest


def peek(root: str | Path) -> tuple[int, dict[str, Any]] | tuple[None, None]:
    """(iteration, manifest) of the checkpoint `latest` names, without hashing its files, or
    (None, None) when there is none yet. UserError when the pointer or the manifest is bad."""
    it = latest_iteration(root)
    if it is None:
        return None, None
    d = iter_dir(root, it)
    if not d.is_dir():
        raise UserError(
            f"{Path(root) / LATEST} names iteration {it}, but {d} does not exist. Point it at an "
            f"existing iter_* directory of {root}, or delete it to start from scratch."
        )
    return it, read_manifest(d)


def check_meta(directory: str | Path, manifest: dict[str, Any], meta_must_match: dict[str, Any]) -> None:
    """UserError when the checkpoint was written with another setup (layout, engine)."""
    diff = {k: (manifest.get(k), v) for k, v in meta_must_match.items() if manifest.get(k) != v}
    if diff:
        details = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diff.items())
        raise UserError(
            f"cannot resume {directory}: it was written with a different setup ({details}). Resume "
            "with the same layout, or convert the checkpoint (`mbr reshard`)."
        )


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def verify(directory: str | Path) -> dict[str, Any]:
    """Check a checkpoint directory against its manifest; raise UserError naming any bad file."""
    d = Path(directory)
    manifest = read_manifest(d)
    bad = []
    for e in manifest["files"]:
        f = d / e["file"]
        if not f.is_file():
            bad.append(f"{e['file']} (missing)")
        elif "bytes" in e and f.stat().st_size != e["bytes"]:
            bad.append(
                f"{e['file']} (size {f.stat().st_size} bytes, the manifest says {e['bytes']}: truncated or overwritten)"
            )
        elif sha256_file(f) != e["sha256"]:
            bad.append(f"{e['file']} (checksum mismatch)")
    if bad:
        raise UserError(
            f"checkpoint {d} is damaged: {', '.join(bad)}. Resume from an earlier iteration "
            "(edit latest_checkpointed_iteration.txt) or re-create it."
        )
    return manifest


def load(root: str | Path, meta_must_match: dict[str, Any]) -> tuple[int, dict[str, Any]] | tuple[None, None]:
    """Load this rank's state from the latest complete checkpoint, or (None, None).
    `meta_must_match` (e.g. the layout) must equal the manifest's values: resuming a per-rank
    checkpoint under another layout would silently load the wrong shards."""
    import torch

    it, _ = peek(root)
    if it is None:
        return None, None
    d = iter_dir(root, it)
    manifest = verify(d)
    check_meta(d, manifest, meta_must_match)
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    state = torch.load(d / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    state["_dir"] = str(d)
    return it, state


def rng_state() -> dict[str, Any]:
    """Every generator a training step draws from (torch, numpy, python, megatron's tracker):
    saved with each rank's state so that a resumed run draws what the uninterrupted one did."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(s: dict[str, Any]) -> None:
    """Put back what `rng_state()` returned."""
    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    tensor_parallel.get_cuda_rng_tracker().set_states(s["tracker"])
