"""Where recipes and config-group options come from: the config search path.

The built-in configs ship inside the package (`megatron_bridge._bundled`: the repository's
top-level `conf/` groups and `recipes/`, laid out like a user dir) and are found through it — `pkg://` on Hydra's search
path — so an installed wheel works from any directory. Users keep their own configs in
their own repositories: a *user config dir* holds `recipes/*.yaml` and any group folder
(`model/`, `cluster/`, `parallel/`, ...), whose files add options or override built-in ones
of the same name. User dirs come ahead of the built-ins, in this order (first found wins):

1. the directory of `recipe=PATH.yaml` (its parent when that directory is named `recipes`),
2. each `--config-dir DIR`, in command-line order,
3. each entry of `$MBR_CONFIG_PATH` (os.pathsep-separated: a cluster's shared configs),
4. the built-ins.

Paths are made absolute here, so a launcher can hand every rank the same explicit list
(`launch_args`) and each rank resolves the same files whatever its working directory.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from megatron_bridge.config.schema import Config
from megatron_bridge.errors import UserError

ENV = "MBR_CONFIG_PATH"
BUILTIN_PACKAGE = "megatron_bridge._bundled"
BUILTIN = "built-in"


def groups() -> tuple[str, ...]:
    """The config groups: the sections of the schema that are dataclasses (model, cluster, ...)."""

    cfg = Config()
    return tuple(f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(getattr(cfg, f.name)))


@dataclasses.dataclass(frozen=True)
class Source:
    """One directory on the search path: group folders under `root`, recipes in `recipes`."""

    origin: str  # where it was named: "recipe=", "--config-dir", "$MBR_CONFIG_PATH" or "built-in"
    root: Path
    recipes: Path
    url: str  # Hydra search-path entry (file://... or pkg://...)

    def option_file(self, group: str, name: str) -> Path:
        return self.root / group / f"{name}.yaml"


def builtin() -> Source:
    base = Path(str(resources.files(BUILTIN_PACKAGE)))
    return Source(BUILTIN, base, base / "recipes", f"pkg://{BUILTIN_PACKAGE}")


def user_source(path: str | Path, origin: str) -> Source:
    root = Path(path).expanduser().absolute()
    if not root.is_dir():
        raise UserError(
            f"config dir {path} (from {origin}) is not a directory. A config dir holds recipes/*.yaml and/or "
            f"group folders ({', '.join(groups())}); create it with `mbr init {path}` or fix the path."
        )
    if not (root / "recipes").is_dir() and not any((root / g).is_dir() for g in groups()):
        raise UserError(
            f"config dir {root} (from {origin}) holds neither recipes/ nor any group folder "
            f"({', '.join(groups())}), so nothing in it can be used. Point {origin} at the directory that "
            f"contains them, or start one with `mbr init {root}`."
        )
    return Source(origin, root, root / "recipes", f"file://{root}")


def is_recipe_path(recipe: str) -> bool:
    return recipe.endswith((".yaml", ".yml")) or os.sep in recipe or "/" in recipe


def recipe_file_source(recipe: str) -> tuple[Path, Source]:
    """`recipe=PATH.yaml`: the file and the user dir it brings (see module doc)."""
    path = Path(recipe).expanduser().absolute()
    if path.suffix != ".yaml":
        raise UserError(
            f"recipe file {recipe}: recipe files end in .yaml (the only extension Hydra loads). Rename it to "
            f"{path.with_suffix('.yaml').name}."
        )
    if not path.is_file():
        raise UserError(
            f"recipe file {recipe} does not exist. Give `recipe=NAME` (a recipe on the search path: "
            "`mbr recipes` lists them) or `recipe=PATH.yaml` (an existing file)."
        )
    root = path.parent.parent if path.parent.name == "recipes" else path.parent
    return path, Source("recipe=", root, path.parent, f"file://{root}")


def search_path(recipe: str, config_dirs: Sequence[str] = ()) -> list[Source]:
    """User dirs (recipe file's, --config-dir, $MBR_CONFIG_PATH), then the built-ins; duplicates once."""
    found: list[Source] = []
    if is_recipe_path(recipe):
        found.append(recipe_file_source(recipe)[1])
    found += [user_source(d, "--config-dir") for d in config_dirs]
    found += [user_source(d, f"${ENV}") for d in os.environ.get(ENV, "").split(os.pathsep) if d]
    found.append(builtin())
    seen: set[tuple[Path, Path]] = set()
    unique = []
    for s in found:
        if (s.root, s.recipes) not in seen:
            seen.add((s.root, s.recipes))
            unique.append(s)
    return unique


def find_recipe(recipe: str, sources: Sequence[Source]) -> Path:
    """The recipe file `recipe=` names: a path, or the first `recipes/NAME.yaml` on the search path."""
    if is_recipe_path(recipe):
        return recipe_file_source(recipe)[0]
    for s in sources:
        if (s.recipes / f"{recipe}.yaml").is_file():
            return s.recipes / f"{recipe}.yaml"
    names = sorted({n for s in sources for n in names_in(s.recipes)})
    raise UserError(
        f"unknown recipe {recipe!r}: the search path has {', '.join(names)}. Pick one with `recipe=NAME`, "
        "give a file with `recipe=PATH.yaml`, or add your config dir with `--config-dir DIR` (or "
        f"${ENV}); `mbr recipes` lists every recipe and where it comes from."
    )


def names_in(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


@dataclasses.dataclass(frozen=True)
class Entry:
    """A recipe or group option as the search path resolves it."""

    name: str
    path: Path
    source: Source
    shadows: tuple[Source, ...]  # lower-priority sources that have the same name (overridden)


def catalogue(sources: Sequence[Source]) -> dict[str, list[Entry]]:
    """`recipes` and every group -> its entries in name order, each with the source that wins."""

    def entries(folders: list[tuple[Source, Path]]) -> list[Entry]:
        by_name: dict[str, list[tuple[Source, Path]]] = {}
        for s, folder in folders:
            for n in names_in(folder):
                by_name.setdefault(n, []).append((s, folder / f"{n}.yaml"))
        return [Entry(n, hits[0][1], hits[0][0], tuple(s for s, _ in hits[1:])) for n, hits in sorted(by_name.items())]

    out = {"recipes": entries([(s, s.recipes) for s in sources])}
    for g in groups():
        out[g] = entries([(s, s.root / g) for s in sources])
    return out


def launch_args(sources: Sequence[Source]) -> list[str]:
    """`--config-dir` flags naming every user dir except the recipe file's (which `recipe=ABS_PATH`
    brings): what a launcher passes to each rank so all resolve the same files."""
    return [f"--config-dir={s.root}" for s in sources if s.origin not in (BUILTIN, "recipe=")]
