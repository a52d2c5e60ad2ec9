"""`mbr check-ckpt dir=DIR [all=true]`: verify a training checkpoint against its manifest.

    mbr check-ckpt dir=runs/ckpt               # or, the same: mbr check-ckpt runs/ckpt
    mbr check-ckpt dir=runs/ckpt all=true      # or: mbr check-ckpt runs/ckpt --all
    mbr check-ckpt dir=runs/ckpt/iter_0000400

DIR (`dir=`, a bare word, or `checkpoint.dir=` as in the recipe) is either a checkpoint root (what `checkpoint.dir=` names: `latest_checkpointed_iteration.txt`
plus `iter_*/`) — then the iteration `latest` names is verified, or every complete one with
`all=true` (`--all`) — or one `iter_N/` directory. Every file listed in the manifest is re-hashed (sha256)
and its size checked. Exit 0 when all is well, 2 naming every missing, truncated or corrupt
file otherwise. Leftovers of interrupted saves (`iter_N.tmp/`, which resuming ignores and the
next save removes) and complete iterations newer than `latest` are reported, not errors.
Imports no torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from omegaconf import MISSING

from megatron_bridge.config.compose import CommandArgs, parse_command
from megatron_bridge.errors import UserError
from megatron_bridge.train.manifest import LATEST, MANIFEST, iter_dir, latest_iteration, verify

USAGE = "usage: mbr check-ckpt DIR [--all]   (DIR: a checkpoint.dir root, or one iter_N directory)"


@dataclass
class CheckCkptArgs(CommandArgs):
    """`mbr check-ckpt`'s fields. `mbr check-ckpt PATH --all` is `mbr check-ckpt dir=PATH all=true`,
    and `checkpoint.dir=PATH` (the recipe's key) is `dir=PATH`."""

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("dir",)
    CLI_FLAGS: ClassVar[dict[str, str]] = {"--all": "all=true"}
    CLI_ALIASES: ClassVar[dict[str, str]] = {"checkpoint.dir": "dir"}
    CLI_USAGE: ClassVar[str] = USAGE

    dir: str = MISSING  # a checkpoint.dir root, or one iter_N directory
    all: bool = False  # verify every complete iteration, not only the one `latest` names


_ITER = re.compile(r"^iter_(\d+)$")


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _verify_one(d: Path) -> str:
    m = verify(d)
    size = sum(int(e.get("bytes", 0)) for e in m["files"])
    extra = "".join(f", {k} {m[k]}" for k in ("layout", "engine") if k in m)
    return (
        f"OK {d}: {len(m['files'])} file(s), {_human(size)}, sha256 verified "
        f"(iteration {m.get('iteration', '?')}, world size {m.get('world_size', '?')}{extra})"
    )


def main(argv: Sequence[str]) -> int:
    args, _ = parse_command(argv, CheckCkptArgs, doc=__doc__)
    root = Path(args.dir)
    if not root.exists():
        raise UserError(f"{root} does not exist. {USAGE}")
    if not root.is_dir():
        raise UserError(f"{root} is a file, not a checkpoint directory. {USAGE}")

    if (root / MANIFEST).is_file() or _ITER.match(root.name) or root.name.endswith(".tmp"):
        if root.name.endswith(".tmp"):
            raise UserError(
                f"{root} is an interrupted save (a .tmp directory is never published): it is not a "
                "checkpoint. Resume from the iteration latest_checkpointed_iteration.txt names."
            )
        print(_verify_one(root))
        return 0

    iters = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _ITER.match(p.name)))
    torn = sorted(p.name for p in root.glob("iter_*.tmp"))
    latest = latest_iteration(root)
    if latest is None:
        if iters:
            raise UserError(
                f"{root} has {len(iters)} iter_* director(ies) but no {LATEST}: no checkpoint was "
                f"published. Check one directly (mbr check-ckpt {iters[-1][1]}) and, if it is OK, "
                f"write its iteration into {root / LATEST}."
            )
        hint = f" (only interrupted saves: {', '.join(torn)})" if torn else ""
        raise UserError(
            f"{root} holds no checkpoint: no {LATEST} and no iter_* directory{hint}. Pass the "
            "directory given as checkpoint.dir=, or one iter_N directory."
        )
    d = iter_dir(root, latest)
    if not d.is_dir():
        raise UserError(
            f"{root / LATEST} names iteration {latest}, but {d} does not exist. Point it at an existing "
            f"iter_* directory ({', '.join(p.name for _, p in iters) or 'none'}), or delete it to "
            "start from scratch."
        )
    notes: list[str] = []
    if torn:
        notes.append(f"note: interrupted save(s) {', '.join(torn)} (ignored on resume, removed by the next save)")
    newer = [p.name for i, p in iters if i > latest]
    if newer:
        notes.append(
            f"note: {', '.join(newer)} newer than latest (iteration {latest}) but never published: resume ignores them"
        )
    targets = [p for _, p in iters if (p / MANIFEST).is_file()] if args.all else [d]
    if d not in targets:
        targets.append(d)
    bad: list[str] = []
    for t in targets:
        try:
            print(_verify_one(t) + (" [latest]" if t == d else ""))
        except UserError as e:
            bad.append(str(e))
    for n in notes:
        print(n)
    if bad:
        raise UserError(bad[0] if len(bad) == 1 else f"{len(bad)} checkpoints are damaged:\n  - " + "\n  - ".join(bad))
    return 0
