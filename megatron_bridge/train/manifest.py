"""Training checkpoints on disk: the layout, the `latest` pointer, the manifest and its
verification — everything but the state itself (`checkpoint.py` writes and reads that), so
`mbr check-ckpt`, `mbr export adapter=true` and the trainer's preflight need no torch.

    DIR/latest_checkpointed_iteration.txt      written last, by rename: the only pointer
    DIR/iter_0000010/rank_00003.pt             one file per rank (checkpoint.py)
    DIR/iter_0000010/manifest.json             layout, iteration, sha256 of every rank file

`verify()` re-hashes the files against the manifest and checks that their pickles name only
tensors and plain values (`scan_pickles`); `peek()` reads the pointer and the manifest
without hashing. Every file name a manifest gives must be a regular file inside the checkpoint
(`convert.formats.paths.confined`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from megatron_bridge.convert.formats.paths import confined
from megatron_bridge.convert.formats.pickle_guard import TRAINING
from megatron_bridge.convert.formats.torch_zip_read import scan_torch_file
from megatron_bridge.convert.sources.megatron import find_megatron
from megatron_bridge.errors import UserError

LATEST = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def is_training_checkpoint(path: str | Path) -> bool:
    """A checkpoint.dir (its `latest` pointer) or one of its iter_N directories (its manifest);
    not an `mbr convert` output or a checkpoint Megatron-LM wrote, whose tracker has the same name."""
    p = Path(path)
    if (p / "mbr_manifest.json").is_file() or find_megatron(p) is not None:
        return False
    return (p / LATEST).is_file() or (p.name.startswith("iter_") and (p / MANIFEST).is_file())


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
    for entry in files:  # names from the file: relative, inside the directory, regular files
        confined(d, entry["file"], source=mf, what="file")
    return manifest


def scan_pickles(directory: str | Path, manifest: dict[str, Any]) -> None:
    """Every `torch.save` file of the checkpoint (`*.pt`: the rank files, DeepSpeed's) names
    only tensors and plain values (`pickle_guard.TRAINING`); UserError naming the first that
    holds anything else. Reads only the pickles (not the tensors' bytes), runs nothing. A file
    it cannot parse is left to the load (weights-only as well, runtime/safe_load.py)."""
    d = Path(directory)
    for e in manifest["files"]:
        if str(e["file"]).endswith(".pt") and (d / e["file"]).is_file():
            scan_torch_file(d / e["file"], TRAINING, strict=False)


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


# Recorded since a later version: a checkpoint written before lacks them and is not compared on them.
RECORDED_LATER = ("model", "grid")


def check_meta(directory: str | Path, manifest: dict[str, Any], meta_must_match: dict[str, Any]) -> None:
    """UserError when the checkpoint was written with another setup (layout, engine, model)."""
    diff = {
        k: (manifest.get(k), v)
        for k, v in meta_must_match.items()
        if manifest.get(k) != v and not (k in RECORDED_LATER and k not in manifest)
    }
    if diff:
        details = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diff.items())
        raise UserError(
            f"cannot resume {directory}: it was written with a different setup ({details}). Resume "
            "with the same layout and model (a layout can be converted: `mbr reshard`), or set a new "
            "checkpoint.dir to start from scratch."
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
    """Check a checkpoint directory against its manifest (sizes, sha256, and that its pickles
    hold only data: `scan_pickles`); raise UserError naming any bad file."""
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
    scan_pickles(d, manifest)
    return manifest


__all__ = [
    "LATEST",
    "MANIFEST",
    "atomic_write_bytes",
    "check_meta",
    "iter_dir",
    "latest_iteration",
    "peek",
    "read_manifest",
    "scan_pickles",
    "sha256_file",
    "verify",
]
