"""Atomic outputs: write under a temporary name next to the target, rename when complete.

A failed or interrupted step leaves no half-written file or directory under the final name;
the temporary is removed on error (a killed process may leave a `.tmp-*` sibling behind,
which is never mistaken for a finished output).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron_bridge.errors import UserError

PathLike = str | os.PathLike


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_mode(path: PathLike, directory: bool = False) -> None:
    """Give a mkstemp/mkdtemp temporary (0600/0700) the mode a normal create would have."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def remove(path: PathLike) -> None:
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def ensure_parent(path: PathLike) -> Path:
    """Create the parent directory of `path` (a clear UserError if that is impossible)."""
    parent = Path(path).absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the output directory {parent}: {e.strerror or e}") from e
    if not os.access(parent, os.W_OK):
        raise UserError(f"the output directory {parent} is not writable")
    return parent


@contextlib.contextmanager
def new_parent(path: PathLike) -> Iterator[Path]:
    """`ensure_parent(path)` for a block that may fail on bad input found while writing: the
    directories it had to create are removed again on error (when still empty), so a refused
    input leaves no trace, not even an empty output directory."""
    parent = Path(path).absolute().parent
    top = parent
    while not top.parent.exists():
        top = top.parent
    created = not parent.exists()
    ensure_parent(path)
    try:
        yield parent
    except BaseException:
        d = parent
        while created and d != top.parent:
            try:
                d.rmdir()
            except OSError:
                break
            d = d.parent
        raise


def refuse_existing(paths: list[PathLike], overwrite: bool, what: str) -> None:
    """UserError when any of `paths` exists and `overwrite` is false."""
    existing = [str(p) for p in paths if os.path.lexists(p) and not _empty_dir(p)]
    if existing and not overwrite:
        raise UserError(
            f"{what} already exists: {', '.join(existing)}. Pick another output or pass overwrite=true to replace it."
        )


def _empty_dir(p: PathLike) -> bool:
    return Path(p).is_dir() and not any(Path(p).iterdir())


@contextlib.contextmanager
def atomic_file(path: PathLike, mode: str = "w", **kwargs) -> Iterator:
    """Open a temporary file next to `path`; rename it to `path` on success."""
    path = Path(path)
    ensure_parent(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
        publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise


def temp_path_for(path: PathLike) -> str:
    """A fresh, unused temporary name next to `path` (caller renames or removes it)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    return tmp


@contextlib.contextmanager
def atomic_dir(path: PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `path`; on success it replaces `path` (an existing
    `path` is removed only after the new one is complete, and only when `overwrite`)."""
    path = Path(path).absolute()
    ensure_parent(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        publish_mode(tmp, directory=True)
        if os.path.lexists(path):
            if not overwrite and not _empty_dir(path):
                raise UserError(f"{path} already exists; pass overwrite=true to replace it")
            trash = temp_path_for(path)
            os.replace(path, trash)
            os.replace(tmp, path)
            remove(trash)
        else:
            os.replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
