"""Every `mbr` command's argv -> one typed object, one way: `parse_command`.

A command's arguments are `key=value` fields of a typed schema (a dataclass: unknown keys and
wrong types are one `error:` paragraph, exit 2) plus `--flags`. For a command that runs a
recipe the schema is `Config` (or a subclass adding the command's own top-level fields) and
the fields are composed with the recipe (`compose`); for one that needs no recipe (`init`,
`check-ckpt`, `recipes`) the schema is just the command's own fields (`CommandArgs`).
`-h`/`--help` prints the command's docstring. Other spellings are declared on the schema, so
they are documented and mean exactly one `key=value`: `CLI_ALIASES` (another key for a field),
`CLI_POSITIONAL` (bare words name these fields in order: `mbr init DIR` is `dir=DIR`) and
`CLI_FLAGS` (a flag that is a field's value: `--all` is `all=true`).

A recipe (`recipes/NAME.yaml`) is a Hydra primary config whose defaults list picks one
option per group (`conf/<group>/`, or a user config dir's `<group>/`: config/search.py) and
starts with `mbr_schema`, the structured schema stored in Hydra's ConfigStore.
`recipe=NAME` (or `recipe=PATH.yaml`) selects the recipe, `--config-dir DIR` adds a user
dir; every other `key=value` is a Hydra override, so any field of any group can be changed
from the command line and `model=NAME` swaps a whole group. Hydra/OmegaConf errors (unknown key, wrong type, missing group option)
become `UserError`s with the fix spelled out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar, overload

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_bridge.config import search
from megatron_bridge.config.schema import Config
from megatron_bridge.errors import HelpRequested, UserError

DEFAULT_RECIPE = "default"


def list_recipes(sources: Sequence[search.Source] | None = None) -> list[str]:
    """Recipe names on the search path (default: $MBR_CONFIG_PATH's dirs and the built-ins)."""
    return [e.name for e in search.catalogue(sources or search.search_path(DEFAULT_RECIPE))["recipes"]]


def list_group(group: str, sources: Sequence[search.Source] | None = None) -> list[str]:
    return [e.name for e in search.catalogue(sources or search.search_path(DEFAULT_RECIPE))[group]]


@dataclasses.dataclass
class Args:
    """The command line split into what Hydra sees and what it must not."""

    recipe: str = DEFAULT_RECIPE
    overrides: list[str] = dataclasses.field(default_factory=list)
    flags: list[str] = dataclasses.field(default_factory=list)  # --dry-run, --list, ...
    cfg: str | None = None  # `--cfg job` prints the resolved config
    config_dirs: list[str] = dataclasses.field(default_factory=list)  # `--config-dir DIR`, repeatable

    def sources(self) -> list[search.Source]:
        return search.search_path(self.recipe, self.config_dirs)


def parse_args(argv: Sequence[str], schema: type | None = None) -> Args:
    """Split argv. Drops DeepSpeed's `--local_rank=N` (its launcher appends it; the env
    variable LOCAL_RANK carries the same value), which Hydra would reject. `schema`'s
    `CLI_POSITIONAL` and `CLI_FLAGS` spellings become the `key=value` they stand for."""
    args = Args()
    positional = list(getattr(schema, "CLI_POSITIONAL", ()))
    flag_fields: dict[str, str] = getattr(schema, "CLI_FLAGS", {})
    spelled: dict[str, tuple[str, str]] = {}  # key -> (the word or flag that named it, its value)
    it = iter(argv)
    for a in it:
        if a.startswith("--local_rank") or a.startswith("--local-rank"):
            if "=" not in a:
                next(it, None)
            continue
        if a == "--config-dir":
            d = next(it, None)
            if d is None or d.startswith("-") or "=" in d:
                raise UserError("--config-dir needs a directory: `--config-dir DIR` or `--config-dir=DIR`.")
            args.config_dirs.append(d)
        elif a.startswith("--config-dir="):
            args.config_dirs.append(a.split("=", 1)[1])
        elif a == "--cfg":
            args.cfg = next(it, "job")
        elif a.startswith("--cfg="):
            args.cfg = a.split("=", 1)[1]
        elif a in flag_fields:
            key, value = flag_fields[a].split("=", 1)
            spelled[key] = (a, value)
            args.overrides.append(flag_fields[a])
        elif a.startswith("-"):
            args.flags.append(a)
        elif a.startswith("recipe="):
            args.recipe = a.split("=", 1)[1]
        elif "=" in a:
            args.overrides.append(a)
        elif positional:
            spelled[positional[0]] = (a, a)
            args.overrides.append(f"{positional.pop(0)}={a}")
        else:
            usage = getattr(schema, "CLI_USAGE", "")
            quote = (
                f" If {a!r} is the rest of the previous value (a path with a space), quote the whole argument: "
                "'key=\"/my dir/x\"' (single quotes for the shell, double quotes inside for Hydra)."
                if any("=" in x for x in argv[: list(argv).index(a)])
                else ""
            )
            raise UserError(
                f"unexpected argument {a!r}: "
                + (
                    usage
                    if usage
                    else "arguments are Hydra overrides `key=value` (e.g. `parallel.tp=2`), `recipe=NAME`, "
                    "or flags starting with `--`."
                )
                + quote
            )
    args.overrides = _once(args.overrides, spelled)
    return args


def _once(overrides: list[str], spelled: dict[str, tuple[str, str]]) -> list[str]:
    """A key named by a word or flag is kept once; given again as `key=value` with another
    value, it is an error."""
    out: list[str] = []
    for o in overrides:
        key, value = o.split("=", 1)
        if key in spelled:
            word, meant = spelled[key]
            if value != meant:
                raise UserError(
                    f"{word} and {key}={value} name the same thing ({word} is another spelling of "
                    f"{key}={meant}) with different values. Give it once."
                )
            if any(x == o for x in out):
                continue
        out.append(o)
    return out


def apply_aliases(overrides: Sequence[str], schema: type) -> list[str]:
    """Rewrite `schema.CLI_ALIASES` spellings to the field they name (an alias that is a field of
    `schema` itself stays that field). Both spellings with different values is an error."""
    names = {f.name for f in dataclasses.fields(schema)}
    aliases = {a: t for a, t in getattr(schema, "CLI_ALIASES", {}).items() if a not in names}
    given = dict(o.split("=", 1) for o in overrides)
    out = []
    for o in overrides:
        key, value = o.split("=", 1)
        if key not in aliases:
            out.append(o)
            continue
        target = aliases[key]
        if target in given and given[target] != value:
            raise UserError(
                f"{key}={value} and {target}={given[target]} name the same thing ({key}= is another spelling "
                f"of {target}=) with different values. Give it once."
            )
        if target not in given:
            out.append(f"{target}={value}")
    return out


def _config_file(config_path: str, recipe_file: Path, sources: Sequence[search.Source]) -> str:
    """Hydra names a config by its search-path name (`mine`, `cluster/my_cluster`); users
    need the file, which is the first source that has it."""
    builtin = search.builtin()
    if config_path == recipe_file.stem:
        return f"built-in recipe {config_path}" if recipe_file.parent == builtin.recipes else str(recipe_file)
    group, _, name = config_path.partition("/")
    for s in sources:
        if name and s.option_file(group, name).is_file():
            return f"built-in {config_path}" if s == builtin else str(s.option_file(group, name))
    return config_path


def _hydra_error(e: Exception, recipe: str, recipe_file: Path, sources: Sequence[search.Source]) -> UserError:
    msg = str(e).strip()
    cause = e.__cause__ or e.__context__
    if cause is not None and str(cause).strip() and str(cause).strip() not in msg:
        msg = f"{msg}: {str(cause).strip()}"
    msg = msg.split("\n    full_key")[0].split("Config search path")[0]
    msg = re.sub(r"To append to your config use \S+: ", "", msg)
    msg = re.sub(r"\S+ raised while composing config:\s*", "", msg)
    where = re.match(r"In '([^']+)':\s*", msg)
    if where:
        msg = msg[where.end() :]
    at = f" in {_config_file(where.group(1), recipe_file, sources)}" if where else ""
    msg = re.sub(r"\s+", " ", msg).strip().rstrip(".")
    grammar = ("LexerNoViableAlt", "token recognition error", "mismatched input", "Ambiguous value", "extraneous input")
    if any(g in msg for g in grammar):
        hint = (
            "A value with spaces, commas, brackets, quotes or non-ASCII characters (a path, usually) must be "
            "quoted for Hydra inside the shell's quotes: 'model.hf_path=\"/data/my models/é,1\"' "
            "(single quotes outside for the shell, double quotes inside for Hydra)."
        )
        msg = re.sub(r"\s*See https://hydra\.cc/\S+ for details", "", msg)
        return UserError(f"invalid configuration{at}: {msg}. {hint}")
    if "could not be converted" in msg or "Value '" in msg and "is not a valid" in msg:
        hint = (
            f"Give the value the field's type (see the schema in `mbr check recipe={recipe} --cfg job`: integers, "
            "floats, true/false, null)."
        )
    else:
        hint = (
            f"Check the spelling of the key against `mbr check recipe={recipe} --cfg job` "
            "(unknown keys are errors, not ignored) and the group options `mbr recipes` lists."
        )
    return UserError(f"invalid configuration{at}: {msg}. {hint}")


def _yaml_error(e: Exception) -> UserError:
    text = re.sub(r"\s+", " ", str(e)).strip()
    return UserError(
        f"a config file is not valid YAML: {text}. Fix the file named above (each key once, `key: value`)."
    )


S = TypeVar("S", bound=Config)


@overload
def compose(argv: Sequence[str] | Args) -> tuple[Config, Args]: ...
@overload
def compose(argv: Sequence[str] | Args, schema: type[S]) -> tuple[S, Args]: ...
def compose(argv: Sequence[str] | Args, schema: type[Config] = Config) -> tuple[Config, Args]:
    """Compose recipe + overrides into an instance of `schema` (a `Config` dataclass or a
    subclass with a command's own fields). Returns (typed config, parsed args). The model
    group stays as the recipe says: `backends.describe(cfg.model)` turns it (or the config.json
    `model.hf_path` names) into the model description."""
    import yaml
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    args = argv if isinstance(argv, Args) else parse_args(argv, schema)
    args.overrides = apply_aliases(args.overrides, schema)
    sources = args.sources()
    recipe_file = search.find_recipe(args.recipe, sources)
    ConfigStore.instance().store(name="mbr_schema", node=schema)
    GlobalHydra.instance().clear()
    entries = ",".join(f"'{s.url}'" for s in sources)
    overrides = list(args.overrides) + [f"hydra.searchpath=[{entries}]"]
    try:
        with initialize_config_dir(config_dir=str(recipe_file.parent), version_base="1.3"):
            dcfg = hydra_compose(config_name=recipe_file.stem, overrides=overrides)
        OmegaConf.resolve(dcfg)
        cfg = OmegaConf.to_object(dcfg)
        if not isinstance(cfg, schema):  # a recipe without `defaults: [mbr_schema, ...]`
            raise UserError(
                f"recipe {recipe_file} does not build on the schema: its first lines must be a defaults list "
                "starting with mbr_schema and ending with _self_ (`defaults: [mbr_schema, {model: tiny_llama}, "
                "_self_]`, as in recipes/default.yaml; `mbr init DIR` writes a starting point)."
            )
    except UserError:
        raise
    except RecursionError:
        raise UserError(
            f"recipe {recipe_file} includes itself (directly, or through another config's defaults list), so "
            "composing it never ends. Remove the entry that names it again from the defaults list."
        ) from None
    except (HydraException, OmegaConfBaseException) as e:
        raise _hydra_error(e, args.recipe, recipe_file, sources) from e
    except yaml.YAMLError as e:
        raise _yaml_error(e) from e
    finally:
        GlobalHydra.instance().clear()
    return cfg, args


HELP = ("-h", "--help")


@dataclasses.dataclass
class CommandArgs:
    """The schema of a command that needs no recipe: subclass it with the command's own fields
    (a field without a default is `MISSING`: required). `CLI_USAGE` ends every argument error;
    `CLI_SEARCH_PATH` lets the command take `recipe=` and `--config-dir` (the config search
    path, without composing anything)."""

    CLI_USAGE: ClassVar[str] = ""
    CLI_SEARCH_PATH: ClassVar[bool] = False

    debug: bool = False  # show the traceback of a user error (errors.run_cli), as for every command


COMMON = {f.name for f in dataclasses.fields(CommandArgs)}
C = TypeVar("C", bound=CommandArgs)


@overload
def parse_command(argv: Sequence[str], schema: type[S], *, doc: str | None) -> tuple[S, Args]: ...
@overload
def parse_command(argv: Sequence[str], schema: type[C], *, doc: str | None) -> tuple[C, Args]: ...
def parse_command(argv: Sequence[str], schema: type[Any], *, doc: str | None) -> tuple[Any, Args]:
    """The one way an `mbr` command reads its argv: `-h`/`--help` shows `doc` (the command's
    docstring); otherwise returns (an instance of `schema`, the parsed args). A `Config` schema
    is composed with its recipe; a `CommandArgs` schema is filled from the `key=value`s alone."""
    if any(a in HELP for a in argv):
        raise HelpRequested((doc or "").strip())
    args = parse_args(argv, schema)
    if issubclass(schema, Config):
        return compose(args, schema)
    return _fields(args, schema), args


def _fields(args: Args, schema: type[C]) -> C:
    """`schema` filled from `args.overrides` (each value given to its field as a string, which
    OmegaConf converts to the field's type); flags, `--cfg` and a recipe are not its to take."""
    usage = schema.CLI_USAGE
    if args.flags:
        raise UserError(f"unknown flag(s) {' '.join(args.flags)}. {usage}".strip())
    if args.cfg is not None:
        raise UserError(f"--cfg prints a composed recipe, and this command composes none. {usage}".strip())
    if not schema.CLI_SEARCH_PATH and (args.recipe != DEFAULT_RECIPE or args.config_dirs):
        raise UserError(f"this command takes no recipe= or --config-dir. {usage}".strip())
    node = OmegaConf.structured(schema)
    for o in apply_aliases(args.overrides, schema):
        key, value = o.split("=", 1)
        try:
            OmegaConf.update(node, key, None if value == "null" else value, merge=True)
        except OmegaConfBaseException as e:
            what = str(e).split("\n")[0].strip().rstrip(".")
            own = [f for f in dataclasses.fields(schema) if f.name not in COMMON]
            keys = ", ".join(
                f"{f.name}= ({f.type})" for f in own + [f for f in dataclasses.fields(schema) if f.name in COMMON]
            )
            fix = "Give the value the field's type" if "Key '" not in what else "Check the spelling of the key"
            raise UserError(f"invalid argument {o}: {what}. {fix}: the keys are {keys}. {usage}".strip()) from e
    missing = sorted(OmegaConf.missing_keys(node))
    if missing:
        raise UserError(f"missing {', '.join(k + '=' for k in missing)}. {usage}".strip())
    obj = OmegaConf.to_object(node)
    assert isinstance(obj, schema)
    return obj


def to_yaml(cfg: object) -> str:
    """The resolved config as YAML (what `--cfg job` prints)."""
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    return OmegaConf.to_yaml(node, resolve=True)
