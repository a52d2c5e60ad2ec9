"""Paths a checkpoint names are confined to its directory.

A manifest (`mbr_manifest.json`'s `files` and `assets`, a training checkpoint's
`manifest.json`), an index (`model.safetensors.index.json`'s `weight_map`) or DCP's
`.metadata` (each chunk's `relative_path`) names files by path. Read from a stranger's
checkpoint, such a name could point anywhere: `/etc/passwd`, `../../secret`, a FIFO that
blocks the reader forever, a device. `confined` admits a name only when it is a relative path
without `..`, stays inside the directory once symbolic links are resolved, and names a regular
file; anything else is refused with a message that names the path, never its bytes, and
nothing is opened.

One exception keeps the Hugging Face cache working: in a hub snapshot
(`.../models--org--name/snapshots/REV/`), files are symbolic links into the repository's
`blobs/`, and a link that resolves there is admitted.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from megatron_bridge.errors import UserError


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def not_regular(path: Path) -> str | None:
    """None when `path` is a regular file (following symbolic links) or does not exist, else
    what it is ("a FIFO (named pipe)", "a directory", ...). Only `stat`s: nothing is opened."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None if stat.S_ISREG(mode) else _kind(mode)


def require_regular(path: Path, what: str = "") -> None:
    """UserError unless `path` is a regular file or absent (a FIFO would block a reader)."""
    kind = not_regular(path)
    if kind is not None:
        raise UserError(
            f"{path}{f' ({what})' if what else ''} is {kind}, not a regular file: refused without "
            "opening it. Replace it with the file itself."
        )


def _inside(target: Path, root: Path) -> bool:
    return target == root or root in target.parents


def _hub_blobs(root: Path) -> Path | None:
    """`.../models--X/blobs` when `root` is a Hugging Face hub snapshot directory."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(("models--", "datasets--")):
        return root.parent.parent / "blobs"
    return None


def confined(
    directory: Path, name: object, *, source: str | Path, what: str = "file", plain: bool = False, verb: str = "names"
) -> Path:
    """`directory / name` for a `name` read from `source` (a manifest, an index): refused
    (UserError) unless it is a relative path without `..` (`plain`: a bare file name) that
    stays inside `directory` after symbolic links, and is a regular file if it exists. A
    missing file is returned as is: the caller says what is missing."""
    shown = repr(name)[:160]
    fix = "Refused without opening it: a checkpoint names only files inside its own directory. Re-create it, or use one from a source you trust."
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UserError(f"{source} {verb} {what} {shown}, which is not a file name. {fix}")
    parts = PurePosixPath(name).parts
    if name.startswith(("/", "\\")) or PurePosixPath(name).is_absolute() or ".." in parts or "\\" in name:
        raise UserError(f"{source} {verb} {what} {shown}: an absolute path or one with '..'. {fix}")
    if plain and len(parts) != 1:
        raise UserError(f"{source} {verb} {what} {shown}: expected a bare file name. {fix}")
    path = directory / name
    root = directory.resolve()
    target = path.resolve()
    blobs = _hub_blobs(root)
    if not (_inside(target, root) or (blobs is not None and _inside(target, blobs.resolve()))):
        raise UserError(f"{source} {verb} {what} {shown}, which leads outside {directory} (to {target}). {fix}")
    kind = not_regular(path)
    if kind is not None:
        raise UserError(
            f"{source} {verb} {what} {shown}, which is {kind}, not a regular file: refused without opening "
            "it (a FIFO or a device would block or feed the reader). Replace it with the file itself."
        )
    return path


__all__ = ["confined", "not_regular", "require_regular"]
