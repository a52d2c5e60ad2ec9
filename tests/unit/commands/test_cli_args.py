"""Commands take arguments one way: every `mbr` command reads its argv through
`config.compose.parse_command` (typed `key=value` fields + `--flags`, `-h`/`--help`), and the
old spellings (`mbr init DIR`, `mbr check-ckpt PATH --all`) mean the `key=value` they stand for."""

import ast
import dataclasses
import hashlib
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge import cli
from megatron_bridge.commands.check_ckpt import CheckCkptArgs
from megatron_bridge.commands.init import InitArgs
from megatron_bridge.commands.recipes import RecipesArgs
from megatron_bridge.config import compose as compose_mod
from megatron_bridge.config import search
from megatron_bridge.config.compose import CommandArgs, parse_command
from megatron_bridge.config.schema import Config
from megatron_bridge.errors import UserError, run_cli
from megatron_bridge.train.checkpoint import LATEST, MANIFEST

PKG = Path(compose_mod.__file__).resolve().parents[1]


def mbr(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


@pytest.fixture(autouse=True)
def _no_env_dirs(monkeypatch):
    monkeypatch.delenv(search.ENV, raising=False)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")  # convert's start-up sets it (setdefault): keep ours


class Reached(Exception):
    pass


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_parses_through_parse_command(name, monkeypatch):
    """Registry check: each command's first look at its arguments is `parse_command` (the spy on
    the `parse_args` it calls stops the command there), with a typed schema."""
    seen = []

    def spy(argv, schema=None):
        seen.append((sys._getframe(1).f_code.co_name, schema))
        raise Reached

    monkeypatch.setattr(compose_mod, "parse_args", spy)
    module, func, _ = cli.COMMANDS[name]
    with pytest.raises(Reached):
        getattr(importlib.import_module(module), func)(["some.key=1"])
    (caller, schema), *_ = seen
    assert caller == "parse_command", (name, caller)
    assert dataclasses.is_dataclass(schema) and issubclass(schema, (Config, CommandArgs)), (name, schema)


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_prints_the_command_docstring(name, flag, capsys):
    """`mbr NAME --help` works for every command, before any other argument is looked at."""
    module = importlib.import_module(cli.COMMANDS[name][0])
    assert run_cli(cli.dispatch, [name, "not-an-argument", flag]) == 0
    out = capsys.readouterr().out
    assert out.strip() == module.__doc__.strip()


def _calls(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.add(f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else "")
    return names


def test_no_command_parses_argv_another_way():
    """The commands (and their bodies in convert/command.py) call neither `compose` nor
    `parse_args` themselves, and only `parse_command` raises `HelpRequested`."""
    files = sorted((PKG / "commands").glob("*.py")) + [PKG / "convert" / "command.py", PKG / "cli.py"]
    for f in files:
        called = _calls(ast.parse(f.read_text()))
        assert not called & {"compose", "parse_args"}, (f, called & {"compose", "parse_args"})
    raisers = []
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None and "HelpRequested" in ast.unparse(node.exc):
                raisers.append(f.relative_to(PKG).as_posix())
    assert raisers == ["config/compose.py"]


def test_init_spellings_agree():
    new, _ = parse_command(["dir=some/where"], InitArgs, doc=None)
    old, _ = parse_command(["some/where"], InitArgs, doc=None)
    assert new == old == InitArgs(dir="some/where")
    assert parse_command(["010"], InitArgs, doc=None)[0].dir == "010"  # a path stays the string given
    assert parse_command(["d", "dir=d"], InitArgs, doc=None)[0] == InitArgs(dir="d")


@pytest.mark.parametrize(
    "argv",
    [
        ["dir=ck", "all=true"],
        ["ck", "--all"],
        ["--all", "ck"],
        ["checkpoint.dir=ck", "--all"],
        ["ck", "all=true"],
        ["ck", "--all", "all=true"],
    ],
)
def test_check_ckpt_spellings_agree(argv):
    args, parsed = parse_command(argv, CheckCkptArgs, doc=None)
    assert args == CheckCkptArgs(dir="ck", all=True) and parsed.flags == []


def test_recipes_takes_only_the_search_path(tmp_path):
    (tmp_path / "recipes").mkdir()
    _, args = parse_command(["--config-dir", str(tmp_path)], RecipesArgs, doc=None)
    assert args.sources() == compose_mod.parse_args(["--config-dir", str(tmp_path)]).sources()


@pytest.mark.parametrize(
    "schema,argv,needle",
    [
        (InitArgs, [], "missing dir="),
        (InitArgs, ["a", "b"], "unexpected argument 'b'"),
        (InitArgs, ["dir=x", "force=true"], "Key 'force' not in 'InitArgs'"),
        (InitArgs, ["dir=x", "debug=maybe"], "'maybe' is not a valid bool"),
        (InitArgs, ["x", "dir=y"], "x and dir=y name the same thing"),
        (InitArgs, ["x", "--force"], "unknown flag(s) --force"),
        (InitArgs, ["x", "recipe=tiny_llama"], "takes no recipe="),
        (InitArgs, ["x", "--cfg", "job"], "composes none"),
        (CheckCkptArgs, [], "missing dir="),
        (CheckCkptArgs, ["a", "b"], "unexpected argument 'b'"),
        (CheckCkptArgs, ["dir=x", "al=true"], "Key 'al' not in 'CheckCkptArgs'"),
        (CheckCkptArgs, ["dir=x", "all=maybe"], "'maybe' is not a valid bool"),
        (CheckCkptArgs, ["x", "--all", "all=false"], "--all and all=false name the same thing"),
        (CheckCkptArgs, ["x", "dir=y"], "x and dir=y name the same thing"),
        (CheckCkptArgs, ["x", "--everything"], "unknown flag(s) --everything"),
        (RecipesArgs, ["foo=1"], "Key 'foo' not in 'RecipesArgs'"),
    ],
)
def test_bad_arguments_are_user_errors(schema, argv, needle):
    with pytest.raises(UserError) as e:
        parse_command(argv, schema, doc=None)
    assert needle in str(e.value)
    assert schema.CLI_USAGE in str(e.value) or "name the same thing" in needle


@pytest.mark.parametrize(
    "args,needle",
    [
        (["init", "dir=x", "force=true"], "Key 'force' not in 'InitArgs'"),
        (["init", "dir=x", "debug=maybe"], "Value 'maybe' is not a valid bool"),
        (["check-ckpt", "dir=x", "al=true"], "Key 'al' not in 'CheckCkptArgs'"),
        (["check-ckpt", "x", "all=maybe"], "Value 'maybe' is not a valid bool"),
    ],
)
def test_bad_key_or_type_exits_2_with_one_error(args, needle, tmp_path):
    r = mbr(*args, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("error:") == 1 and r.stdout == ""
    assert not (tmp_path / "x").exists()


def test_init_old_and_new_spelling_write_the_same(tmp_path):
    for spelling in (["old"], ["dir=new"]):
        r = mbr("init", *spelling, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
    for rel in ("recipes/my_recipe.yaml", "cluster/my_cluster.yaml"):
        assert (tmp_path / "old" / rel).read_text().replace("old", "DIR") == (
            tmp_path / "new" / rel
        ).read_text().replace("new", "DIR")


def _checkpoint(root: Path, iterations) -> Path:
    """A checkpoint root in the trainer's format (train/checkpoint.py), without torch."""
    for it in iterations:
        d = root / f"iter_{it:07d}"
        d.mkdir(parents=True)
        data = bytes(range(it, it + 64))
        (d / "rank_00000.pt").write_bytes(data)
        entry = {"file": "rank_00000.pt", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (d / MANIFEST).write_text(json.dumps({"iteration": it, "world_size": 1, "files": [entry]}))
    (root / LATEST).write_text(f"{iterations[-1]}\n")
    return root


def test_check_ckpt_old_and_new_spelling_give_the_same_result(tmp_path, capsys):
    from megatron_bridge.commands import check_ckpt

    root = _checkpoint(tmp_path / "ck", [2, 4])
    outputs = {}
    for argv in ([str(root), "--all"], [f"dir={root}", "all=true"], [f"checkpoint.dir={root}", "--all"]):
        assert check_ckpt.main(argv) == 0
        outputs[" ".join(argv)] = capsys.readouterr().out
    assert len(set(outputs.values())) == 1, outputs
    assert "iter_0000002" in next(iter(outputs.values())) and "[latest]" in next(iter(outputs.values()))
    assert check_ckpt.main([str(root)]) == 0
    assert "iter_0000002" not in capsys.readouterr().out  # without all=true: only the iteration `latest` names
