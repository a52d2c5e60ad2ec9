"""Checkpoints written by Megatron-LM, NeMo 2 and Megatron-Bridge: found from what the user names.

All three write megatron-core's formats, so one reader serves them once the weights are found:

* Megatron-LM: `DIR/latest_checkpointed_iteration.txt` names an iteration (`iter_0000010/`)
  or `release` (`release/`); that directory holds torch_dist (`.metadata`, `*.distcp`,
  `common.pt` with the run's `args`, `metadata.json`) or the per-rank `torch` format
  (`mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`, each with `args`). The user may name DIR or
  the iteration directory itself.
* Megatron-Bridge: the same tracker and `iter_N/` directories (torch_dist), with the run's
  `run_config.yaml` beside the weights instead of `args`.
* NeMo 2: a checkpoint directory holding `weights/` (torch_dist, keys under `module.`) and
  `context/` (`model.yaml`: the model's config).

`find_megatron` says which, where the weights are and which config files describe them,
reading only names and small text files; `common_state` reads `common.pt` / rank 0's file as
data (`pickle_guard.MEGATRON`: the names megatron-core's own loader admits; anything else is
refused naming it, nothing is run). An `mbr convert` output (`mbr_manifest.json`) and a
training checkpoint of this project (`manifest.json` in its iteration directories) are not
Megatron checkpoints here, though they share the tracker's name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_bridge.convert.formats.paths import require_regular
from megatron_bridge.convert.formats.safetensors_io import PositionedReader
from megatron_bridge.convert.formats.torch_zip_read import MEGATRON_STANDINS, LazyTorchFile
from megatron_bridge.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
RANK_FILE = "model_optim_rng.pt"
ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
OURS = ("mbr_manifest.json", "manifest.json")  # an `mbr convert` output / our training checkpoint's iteration


@dataclass(frozen=True)
class MegatronDir:
    """Where a Megatron-written checkpoint's weights are, and what else describes them."""

    given: Path  # what the user named
    data: Path  # the directory holding `.metadata` (torch_dist) or the `mp_rank_*` directories
    format: str  # "torch_dist" | "torch"
    writer: str  # "Megatron-LM" | "Megatron-Bridge" | "NeMo"
    iteration: int  # 0 for `release`
    prefix: str = ""  # of every torch_dist key (NeMo 2: "module.")
    configs: tuple[Path, ...] = ()  # run_config.yaml (Megatron-Bridge), context/model.yaml (NeMo)
    ranks: tuple[tuple[tuple[int, int, int], str], ...] = field(default=())  # ((tp, pp, ep), directory name)

    def describe(self) -> str:
        return f"{self.writer} checkpoint ({self.format}, iteration {self.iteration or 'release'})"


def _tracked(root: Path) -> Path | None:
    """The iteration directory `root`'s tracker names (UserError when it names one that is not there)."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text(errors="replace").strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None:
        raise UserError(
            f"{tracker} holds {text[:40]!r}; Megatron writes an iteration number or `release` there. "
            "Write the iteration to read (e.g. 1000), or name its iter_NNNNNNN directory instead."
        )
    data = root / name
    if not data.is_dir():
        raise UserError(
            f"{tracker} names {name}, which {root} does not hold (an interrupted save, or a copied tracker): "
            "name an iteration directory that is there, or fix the tracker."
        )
    return data


def _ours(path: Path) -> bool:
    return any((path / n).is_file() for n in OURS)


def _weights(data: Path) -> tuple[str, tuple[tuple[tuple[int, int, int], str], ...]] | None:
    """The format of a directory of weights, and its rank directories (torch), or None."""
    if (data / ".metadata").is_file() and (data / "metadata.json").is_file():
        return "torch_dist", ()
    ranks = []
    for p in sorted(data.iterdir()) if data.is_dir() else []:
        m = RANK_DIR.match(p.name)
        if m and (p / RANK_FILE).is_file():
            tp, pp, ep = (int(g) if g else 0 for g in m.groups())
            ranks.append(((tp, pp, ep), p.name))
    return ("torch", tuple(ranks)) if ranks else None


def find_megatron(path: str | Path) -> MegatronDir | None:
    """The Megatron-written checkpoint at `path` (see the module doc), or None if it is not one."""
    given = Path(path)
    if not given.is_dir() or _ours(given):
        return None
    if (given / "weights").is_dir() and (given / "context").is_dir():  # NeMo 2
        found = _weights(given / "weights")
        if found is None or found[0] != "torch_dist":
            return None
        configs = tuple(p for p in [given / "context" / "model.yaml"] if p.is_file())
        return MegatronDir(given, given / "weights", "torch_dist", "NeMo", _nemo_step(given), "module.", configs)
    data = _tracked(given)
    if data is None and ITER_DIR.match(given.name):
        data = given
    if data is None or _ours(data):
        return None
    found = _weights(data)
    if found is None:
        return None
    fmt, ranks = found
    iteration = 0 if data.name == "release" else int(data.name[len("iter_") :])
    run_config = data / "run_config.yaml"
    writer = "Megatron-Bridge" if run_config.is_file() else "Megatron-LM"
    configs = (run_config,) if run_config.is_file() else ()
    return MegatronDir(given, data, fmt, writer, iteration, "", configs, ranks)


def _nemo_step(path: Path) -> int:
    m = re.search(r"step=(\d+)", path.name)
    return int(m.group(1)) if m else 0


def rank_file(md: MegatronDir, tp: int, pp: int, ep: int) -> Path:
    """The per-rank file of (tp, pp, ep) (`mp_rank_TT[_PPP][_EEE]`, as Megatron-LM's
    `get_checkpoint_name` names it); UserError naming the ranks there when it is missing."""
    names = dict(md.ranks)
    if (tp, pp, ep) not in names:
        raise UserError(
            f"{md.data} has no rank file of tp rank {tp}, pp rank {pp}, ep rank {ep} (it holds "
            f"{', '.join(sorted(names.values()))}): an incomplete copy of the checkpoint"
        )
    return md.data / names[(tp, pp, ep)] / RANK_FILE


def common_state(md: MegatronDir, io: PositionedReader) -> dict[str, Any]:
    """The checkpoint's non-tensor state as data: torch_dist's `common.pt` (`args`,
    `iteration`, `content_metadata`, ...) or rank 0's file's top level without its tensors
    ({} where neither exists: NeMo's `common.pt` is optional)."""
    if md.format == "torch_dist":
        path = md.data / "common.pt"
        if not path.exists():
            return {}
    else:
        path = rank_file(md, 0, 0, 0)
    require_regular(path)
    obj = LazyTorchFile(path, io, extra=MEGATRON_STANDINS).obj
    if not isinstance(obj, dict):
        raise UserError(f"{path}: not a Megatron checkpoint file (it holds a {type(obj).__name__}, not a dict)")
    return obj


__all__ = ["MegatronDir", "TRACKER", "common_state", "find_megatron", "rank_file"]
