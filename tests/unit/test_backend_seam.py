"""A backend is one object behind a seam: shared code asks it for capabilities and never tests
which backend it is (docs/contributing.md, "Adding a backend"). Read from the source (AST): no
module outside a backend's own packages and the seam itself compares a value with a backend's
name, or picks a registered backend by name."""

from __future__ import annotations

import ast
from pathlib import Path

import megatron_bridge
from megatron_bridge.backends.registry import ALIASES, BACKENDS

ROOT = Path(megatron_bridge.__file__).parent
NAMES = {*BACKENDS, *ALIASES}
# a backend's own code, and the seam that registers and chooses them
OWN = ("backends/native/", "backends/transformers/", "runtime/native/", "runtime/transformers/")
SEAM = ("backends/registry.py", "backends/describe.py", "backends/base.py", "runtime/runtimes.py")
BACKEND_COMMANDS = ("commands/verify_matrix_transformers.py",)  # the transformers backend's own catalogue


def _shared() -> list[Path]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        if not rel.startswith(OWN) and rel not in SEAM and rel not in BACKEND_COMMANDS:
            out.append(p)
    return out


def _name_tests(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            consts = [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            for p in parts:  # `x in ("native", "transformers")`
                if isinstance(p, (ast.Tuple, ast.List, ast.Set)):
                    consts += [e.value for e in p.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if set(consts) & NAMES:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in NAMES:
            if isinstance(node.value, ast.Name) and node.value.id in ("BACKENDS", "RUNTIMES"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_shared_module_tests_a_backends_name():
    bad = {str(p.relative_to(ROOT)): hits for p in _shared() if (hits := _name_tests(ast.parse(p.read_text())))}
    assert not bad, bad


def test_the_check_sees_a_name_test():
    """The scan finds what it is for (a check that cannot fail is no check)."""
    code = 'if spec.backend == "transformers": pass\nb = BACKENDS["native"]\nok = name in ("auto", "hf")'
    assert len(_name_tests(ast.parse(code))) == 3
    assert not _name_tests(ast.parse('if c.backend == "gloo": pass'))  # a process-group backend is no model backend
