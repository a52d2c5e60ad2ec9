"""The rules come from one ordered list, each declaring what it reads, and docs/config.md's
rule tables are that list."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from megatron_bridge.backends import describe as describe_module
from megatron_bridge.parallel.rules import base
from megatron_bridge.parallel.rules.registry import LAYOUT_RULES, RULE_MODULES, RULES

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def _produced(fn) -> list[str]:
    return list(dict.fromkeys(re.findall(r'_v\(\s*"([a-z0-9-]+)"', inspect.getsource(fn))))


def _doc_table(heading: str) -> list[list[str]]:
    text = DOC.read_text().split(heading, 1)[1]
    rows = []
    for line in text.splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("#", "rule") or set(cells[0]) <= {"-"}:
            continue
        rows.append(cells)
    return rows


def test_docs_registry_table_is_the_registry():
    want = [
        [
            str(i),
            f"`{m.__name__.rsplit('.', 1)[1]}`",
            f"`{r.name}`",
            ", ".join(x for x in base.READS if x in r.reads),
            "layout" if r.layout_rule else "run",
            ", ".join(f"`{n}`" for n in _produced(r.fn)),
        ]
        for i, (m, r) in enumerate(((m, r) for m in RULE_MODULES for r in m.RULES), 1)
    ]
    assert _doc_table("### The registry, in order") == want


def test_every_violation_is_documented_and_every_documented_one_exists():
    produced = {n for r in RULES for n in _produced(r.fn)}
    produced |= set(re.findall(r'_refused\(\s*"([a-z0-9-]+)"', inspect.getsource(describe_module)))
    documented = {
        n for row in _doc_table("### What each violation requires") for n in re.findall(r"`([a-z0-9-]+)`", row[0])
    }
    documented |= {n for row in _doc_table("### Value rules") for n in re.findall(r"`([a-z0-9-]+)`", row[0])}
    assert produced == documented


def test_rule_modules_are_listed_once_and_every_rule_is_registered():
    assert len(set(RULE_MODULES)) == len(RULE_MODULES)
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    for m in RULE_MODULES:  # a function decorated in a module is in that module's RuleSet
        decorated = re.findall(r"@RULES\.(?:layout|run)\(reads=[^)]*\)\)?\ndef (\w+)", inspect.getsource(m))
        assert decorated == [r.name for r in m.RULES], m.__name__
    assert set(LAYOUT_RULES) == {r for r in RULES if r.layout_rule}


def test_reading_an_undeclared_fact_fails():
    rs = base.RuleSet()

    @rs.run(reads=("run",))
    def peeks(f):
        return [] if f.model else []

    with pytest.raises(AssertionError, match="peeks reads `model`"):
        rs[0](None, object(), object())
    with pytest.raises(TypeError, match="reads="):
        rs.run(reads=("weather",))
