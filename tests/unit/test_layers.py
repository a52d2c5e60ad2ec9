"""The package in two layers (docs/contributing.md): a torch-free core, a runtime layer that
imports torch and megatron like ordinary Python, and the commands on top. Read from the source
(AST), counting imports inside functions too, so no lazy import can hide a dependency."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_bridge

ROOT = Path(megatron_bridge.__file__).parent
PKG = "megatron_bridge"
# every module belongs to exactly one layer, by its dotted prefix
CORE = (
    "errors",
    "flock",
    "forking",
    "ordered_registry",
    "log_filters",
    "config",
    "parallel",
    "bridge",
    "backends",
    "plan",
    "convert",
    "data",
    "_bundled",
)
RUNTIME = ("runtime", "train", "reliability", "stream")
TOP = ("commands", "cli", "testing", "fork_launch", "fork_server", "demo", "demo_vlm", "__init__")
HEAVY = ("torch", "megatron", "deepspeed", "transformers", "peft", "safetensors")
MAX_IN_FUNCTION = 40  # imports of our own modules inside functions, package-wide


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT).with_suffix("")
        parts = [PKG, *rel.parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def layer(module: str) -> str:
    if module.endswith(".__main__"):  # `python -m megatron_bridge.X`: an entry point, like a command
        return "top"
    first = module.split(".")[1] if module.count(".") else "__init__"
    for name, prefixes in (("core", CORE), ("runtime", RUNTIME), ("top", TOP)):
        if first in prefixes:
            return name
    raise AssertionError(f"{module} is in no layer: add its package to CORE, RUNTIME or TOP")


DEFERRED = re.compile(rf"{PKG}(\.\w+)+:\w+")  # runtime.build_base.later's targets


def _resolve(name: str) -> str | None:
    """The module an import names (`from pkg import mod` names pkg.mod; `from pkg import x` pkg)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(module: str, *, typing: bool = True) -> list[tuple[str, int, bool, ast.stmt]]:
    """(imported module, line, inside a function, node) for every import of ours or of a heavy
    package in `module`, wherever it is (module level, function; `if TYPE_CHECKING:` blocks,
    which never execute, only with `typing`)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    in_function: set[int] = set()
    type_only: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function |= {id(n) for n in ast.walk(fn) if n is not fn}
        if isinstance(fn, ast.If) and "TYPE_CHECKING" in ast.unparse(fn.test):
            type_only |= {id(n) for n in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        if not typing and id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            base = node.module or ""
            names = [
                f"{base}.{a.name}" if _resolve(f"{base}.{a.name}") == f"{base}.{a.name}" else base for a in node.names
            ]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DEFERRED.fullmatch(node.value):
            names = [node.value.partition(":")[0]]  # `later("module:function")`: imported at its first call
        else:
            continue
        deferred = isinstance(node, ast.Constant)
        for name in names:
            target = _resolve(name) if name.startswith(PKG + ".") or name == PKG else name.split(".")[0]
            if target:
                out.append((target, node.lineno, deferred or id(node) in in_function, node))
    return out


def test_every_module_is_in_one_layer():
    for m in MODULES:
        layer(m)


@pytest.mark.parametrize("lower,forbidden", [("core", ("runtime", "top")), ("runtime", ("top",))])
def test_a_layer_never_imports_a_higher_one(lower, forbidden):
    bad = [
        f"{m}:{line} imports {t}"
        for m in MODULES
        if layer(m) == lower
        for t, line, _, _ in imports(m)
        if t.startswith(PKG) and layer(t) in forbidden
    ]
    assert not bad, bad


def test_core_imports_no_heavy_package_at_module_level():
    bad = [
        f"{m}:{line} imports {t}"
        for m in MODULES
        if layer(m) == "core"
        for t, line, inside, _ in imports(m, typing=False)
        if t in HEAVY and not inside
    ]
    assert not bad, bad


def test_no_import_cycle_counting_imports_inside_functions():
    graph = {m: {t for t, _, _, _ in imports(m, typing=False) if t.startswith(PKG) and t != m} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for m in graph:
        if m not in index:
            visit(m)
    assert not cycles, cycles


def test_few_imports_of_our_modules_inside_functions_each_with_a_reason():
    found, unexplained = [], []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for t, line, inside, _ in imports(m):
            if inside and t.startswith(PKG):
                found.append(f"{m}:{line}")
                here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
                if "#" not in here and not above.strip().startswith("#"):
                    unexplained.append(f"{m}:{line} imports {t}")
    found = sorted(set(found))
    assert len(found) <= MAX_IN_FUNCTION, found
    assert not unexplained, unexplained


def test_no_class_is_built_inside_a_function():
    """A class is an ordinary top-level class (runtime modules import torch at the top), not
    one built lazily in a function and cached in a module global."""
    bad = []
    for m, path in MODULES.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bad += [f"{m}:{c.lineno} {c.name}" for c in ast.walk(fn) if isinstance(c, ast.ClassDef)]
    assert not bad, bad


def test_importing_the_core_imports_neither_torch_nor_megatron():
    code = (
        "import sys; import megatron_bridge.config, megatron_bridge.parallel, megatron_bridge.plan, "
        "megatron_bridge.convert, megatron_bridge.bridge, megatron_bridge.backends\n"
        "from megatron_bridge.parallel.rules import registry; from megatron_bridge.backends import describe\n"
        "from megatron_bridge.convert.pipeline import run\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'deepspeed', 'transformers'))\n"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", out
