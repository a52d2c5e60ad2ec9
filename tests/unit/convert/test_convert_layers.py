"""convert/ in layers (megatron_bridge/convert/__init__.py): formats <- placement <- sources <-
bytemove <- pipeline, each sub-package importing only from itself and the layers before it;
formats/ knows no model (it imports no megatron_bridge module outside itself but `errors`);
no `__init__.py` with behaviour (a docstring, imports and `__all__` only)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_bridge.convert

ROOT = Path(megatron_bridge.convert.__file__).parent
LAYERS = ("formats", "placement", "sources", "bytemove", "pipeline")
PREFIX = "megatron_bridge.convert."


def imports(path: Path) -> set[str]:
    """The modules `path` imports, anywhere in the file (inside functions and `if
    TYPE_CHECKING:` too); `from PKG import mod` counts as PKG.mod."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def convert_imports(path: Path) -> set[str]:
    return {m for m in imports(path) if m.startswith(PREFIX)}


def layer_of(module: str) -> str | None:
    part = module[len(PREFIX) :].split(".")[0]
    return part if part in LAYERS else None


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_imports_only_itself_and_the_layers_before_it(layer):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    files = sorted((ROOT / layer).glob("*.py"))
    assert len(files) > 1
    bad = [
        f"{f.relative_to(ROOT)} imports {m}"
        for f in files
        for m in sorted(convert_imports(f))
        if layer_of(m) not in allowed
    ]
    assert not bad, bad


def test_formats_know_no_model():
    """The files alone: no bridge (model tables, spec, layout names), no config, no parallel."""
    own = ("megatron_bridge.convert.formats", "megatron_bridge.errors")
    bad = [
        f"{f.relative_to(ROOT)} imports {m}"
        for f in sorted((ROOT / "formats").glob("*.py"))
        for m in sorted(imports(f))
        if m.split(".")[0] == "megatron_bridge" and not m.startswith(own)
    ]
    assert not bad, bad


def test_every_module_is_in_a_layer_or_a_named_entry_point():
    assert {p.name for p in ROOT.glob("*.py")} == {"__init__.py", "command.py"}
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)


@pytest.mark.parametrize("init", sorted(ROOT.rglob("__init__.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_init_files_hold_no_behaviour(init):
    tree = ast.parse(init.read_text())
    assert ast.get_docstring(tree), f"{init}: say what the package holds"
    for node in tree.body[1:]:
        is_all = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        assert isinstance(node, (ast.Import, ast.ImportFrom)) or is_all, f"{init}:{node.lineno}: not a re-export"
