"""Compose a recipe + CLI overrides into one typed `Config`.

A recipe (`recipes/NAME.yaml`) is a Hydra primary config whose defaults list picks one
option per group from `conf/` and starts with `mbr_schema`, the structured schema stored
in Hydra's ConfigStore. `recipe=NAME` selects the recipe; every other `key=value` is a Hydra
override, so any field of any group can be changed from the command line and `model=NAME`
swaps a whole group. Hydra/OmegaConf errors (unknown key, wrong type, missing group option)
become `UserError`s with the fix spelled out.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar, overload

from omegaconf import DictConfig, OmegaConf

from megatron_bridge.config.hf_model import apply_hf_config
from megatron_bridge.config.schema import Config
from megatron_bridge.errors import UserError

DEFAULT_RECIPE = "default"


def repo_root() -> Path:
    """Directory holding `conf/` and `recipes/` (the source tree; installs are editable)."""
    env = os.environ.get("MBR_HOME")
    root = Path(env) if env else Path(__file__).resolve().parents[2]
    if not (root / "conf").is_dir() or not (root / "recipes").is_dir():
        raise UserError(
            f"cannot find conf/ and recipes/ under {root}. Install megatron_bridge editable "
            "from its source tree (`pip install -e .`) or set MBR_HOME to the source tree."
        )
    return root


def conf_dir() -> Path:
    return repo_root() / "conf"


def recipes_dir() -> Path:
    return repo_root() / "recipes"


def list_recipes() -> list[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def list_group(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@dataclasses.dataclass
class Args:
    """The command line split into what Hydra sees and what it must not."""

    recipe: str = DEFAULT_RECIPE
    overrides: list[str] = dataclasses.field(default_factory=list)
    flags: list[str] = dataclasses.field(default_factory=list)  # --dry-run, --list, ...
    cfg: str | None = None  # `--cfg job` prints the resolved config


def parse_args(argv: Sequence[str]) -> Args:
    """Split argv. Drops DeepSpeed's `--local_rank=N` (its launcher appends it; the env
    variable LOCAL_RANK carries the same value), which Hydra would reject."""
    args = Args()
    it = iter(argv)
    for a in it:
        if a.startswith("--local_rank") or a.startswith("--local-rank"):
            if "=" not in a:
                next(it, None)
            continue
        if a == "--cfg":
            args.cfg = next(it, "job")
        elif a.startswith("--cfg="):
            args.cfg = a.split("=", 1)[1]
        elif a.startswith("-"):
            args.flags.append(a)
        elif a.startswith("recipe="):
            args.recipe = a.split("=", 1)[1]
        elif "=" in a:
            args.overrides.append(a)
        else:
            raise UserError(
                f"unexpected argument {a!r}: arguments are Hydra overrides `key=value` "
                "(e.g. `parallel.tp=2`), `recipe=NAME`, or flags starting with `--`."
            )
    return args


def _hydra_error(e: Exception, recipe: str) -> UserError:
    msg = str(e).strip()
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg = f"{msg}: {str(cause).strip()}"
    msg = msg.split("\n    full_key")[0].split("Config search path")[0]
    msg = re.sub(r"To append to your config use \S+: ", "", msg)
    msg = re.sub(r"\s+", " ", msg).strip().rstrip(".")
    if "could not be converted" in msg or "Value '" in msg and "is not a valid" in msg:
        hint = (
            f"Give the value the field's type (see the schema in `mbr check recipe={recipe} --cfg job`: integers, "
            "floats, true/false, null)."
        )
    else:
        hint = (
            f"Check the spelling of the key against `mbr check recipe={recipe} --cfg job` "
            "(unknown keys are errors, not ignored) and the option names in conf/<group>/."
        )
    return UserError(f"invalid configuration: {msg}. {hint}")


S = TypeVar("S", bound=Config)


@overload
def compose(argv: Sequence[str] | Args, *, resolve_hf: bool = ...) -> tuple[Config, Args]: ...
@overload
def compose(argv: Sequence[str] | Args, schema: type[S], *, resolve_hf: bool = ...) -> tuple[S, Args]: ...
def compose(
    argv: Sequence[str] | Args, schema: type[Config] = Config, *, resolve_hf: bool = True
) -> tuple[Config, Args]:
    """Compose recipe + overrides into an instance of `schema` (a `Config` dataclass or a
    subclass with a command's own fields). Returns (typed config, parsed args)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = argv if isinstance(argv, Args) else parse_args(argv)
    if args.recipe not in list_recipes():
        raise UserError(
            f"unknown recipe {args.recipe!r}: recipes are the files in {recipes_dir()} "
            f"({', '.join(list_recipes())}). Pick one with `recipe=NAME`."
        )
    ConfigStore.instance().store(name="mbr_schema", node=schema)
    GlobalHydra.instance().clear()
    overrides = list(args.overrides) + [f"hydra.searchpath=[file://{conf_dir()}]"]
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base="1.3"):
            dcfg = hydra_compose(config_name=args.recipe, overrides=overrides)
        if resolve_hf and dcfg.model.hf_path:
            apply_hf_config(dcfg.model, dcfg.model.hf_path)
        OmegaConf.resolve(dcfg)
        cfg = OmegaConf.to_object(dcfg)
        assert isinstance(cfg, schema)  # a structured config converts back to its dataclass
    except UserError:
        raise
    except (HydraException, OmegaConfBaseException) as e:
        raise _hydra_error(e, args.recipe) from e
    finally:
        GlobalHydra.instance().clear()
    return cfg, args


def to_yaml(cfg: object) -> str:
    """The resolved config as YAML (what `--cfg job` prints)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_yaml(node, resolve=True)
