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
`.tmp` directories are ignored and removed by the next save. `verify()` re-hashes the files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from megatron_bridge.errors import UserError

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"


def iter_dir(root: Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def save(root: str | Path, iteration: int, state: Dict[str, Any], meta: Dict[str, Any],
         extra: Optional[Callable[[Path], None]] = None) -> Path:
    """Collective: every rank calls it with its own `state`. `extra(tmp_dir)`, when given, is
    called on every rank to write engine-owned files (DeepSpeed's ZeRO partitions) into the
    same not-yet-published directory; rank 0 checksums those too. Returns the final directory."""
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
    entries = [None] * world
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
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_bytes(root / LATEST, f"{iteration}\n".encode())
    if dist:
        dist.barrier()
    return final


def latest_iteration(root: str | Path) -> Optional[int]:
    """Iteration named by the `latest` pointer, or None when there is no checkpoint."""
    p = Path(root) / LATEST
    if not p.is_file():
        return None
    text = p.read_text().strip()
    if not text.isdigit():
        raise UserError(f"{p} is corrupt (content {text!r}); delete it to restart, or restore the file.")
    return int(text)


def verify(directory: str | Path) -> Dict[str, Any]:
    """Check a checkpoint directory against its manifest; raise UserError naming any bad file."""
    d = Path(directory)
    mf = d / MANIFEST
    if not mf.is_file():
        raise UserError(f"{d} has no {MANIFEST}: it is not a complete checkpoint (an interrupted save?).")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{mf} is corrupt ({e}).") from e
    bad = []
    for e in manifest["files"]:
        f = d / e["file"]
        if not f.is_file():
            bad.append(f"{e['file']} (missing)")
        elif hashlib.sha256(f.read_bytes()).hexdigest() != e["sha256"]:
            bad.append(f"{e['file']} (checksum mismatch)")
    if bad:
        raise UserError(f"checkpoint {d} is damaged: {', '.join(bad)}. Resume from an earlier iteration "
                        "(edit latest_checkpointed_iteration.txt) or re-create it.")
    return manifest


def load(root: str | Path, meta_must_match: Dict[str, Any]) -> Tuple[int, Dict[str, Any]] | Tuple[None, None]:
    """Load this rank's state from the latest complete checkpoint, or (None, None).
    `meta_must_match` (e.g. the layout) must equal the manifest's values: resuming a per-rank
    checkpoint under another layout would silently load the wrong shards."""
    it = latest_iteration(root)
    if it is None:
        return None, None
    d = iter_dir(root, it)
    manifest = verify(d)
    diff = {k: (manifest.get(k), v) for k, v in meta_must_match.items() if manifest.get(k) != v}
    if diff:
        details = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diff.items())
        raise UserError(f"cannot resume {d}: it was written with a different setup ({details}). Resume with the "
                        "same layout, or convert the checkpoint (`mbr reshard`).")
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    state = torch.load(d / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=False)
    state["_dir"] = str(d)
    return it, state
