"""What a rule is: a function of the facts it declares it reads, returning its violations.

A rule reads some of three things — the `layout` (the resolved `ParallelDims`: degrees, stage
split, batch arithmetic), the `model` (the one description, `bridge.spec.BridgeSpec`) and the
`run` values (the composed `Config`: optimizer, train, data, checkpoint, peft, cluster
switches) — and says which in `reads=`. `Facts` hands it exactly those: reading anything else
is a bug in the rule and fails loudly, so the declaration is always true. A rule that reads no
layout gives the same answer for every candidate layout of one recipe, which is what lets
`mbr plan` refuse a bad learning rate once instead of per layout.

Two scopes: a layout rule (`RULES.layout`) decides whether the model can be built and split
under the degrees — `mbr check`, `mbr plan`, training, `mbr convert` and `mbr verify` all apply
these, so the five accept the same layouts; a run rule (`RULES.run`) concerns one training run
only (batch arithmetic, schedules, ZeRO and engine, values, node placement).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

READS = ("layout", "model", "run")


@dataclass(frozen=True)
class Violation:
    rule: str
    detail: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.detail}. Fix: {self.fix}."


def violation(rule: str, detail: str, fix: str) -> list[Violation]:
    """One violation, as the list a rule returns."""
    return [Violation(rule, detail, fix)]


class Facts:
    """The facts one rule declared; an undeclared one raises (a bug in the rule, not input)."""

    __slots__ = ("_values", "_reads", "_rule")

    def __init__(self, rule: str, reads: frozenset[str], layout: Any, model: Any, run: Any) -> None:
        self._values = {"layout": layout, "model": model, "run": run}
        self._reads, self._rule = reads, rule

    def _get(self, what: str) -> Any:
        if what not in self._reads:
            raise AssertionError(f"rule {self._rule} reads `{what}` but declares reads={sorted(self._reads)}")
        return self._values[what]

    @property
    def layout(self) -> Any:
        return self._get("layout")

    @property
    def model(self) -> Any:
        return self._get("model")

    @property
    def run(self) -> Any:
        return self._get("run")


RuleFn = Callable[[Facts], list[Violation]]


@dataclass(frozen=True)
class Rule:
    fn: RuleFn
    reads: frozenset[str]
    layout_rule: bool  # also applied by convert and verify (see the module doc)

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()

    def __call__(self, layout: Any, model: Any, run: Any) -> list[Violation]:
        return self.fn(Facts(self.name, self.reads, layout, model, run))


class RuleSet(list[Rule]):
    """A rule module's rules, in the order the module defines them."""

    def _add(self, reads: tuple[str, ...], layout_rule: bool) -> Callable[[RuleFn], RuleFn]:
        unknown = set(reads) - set(READS)
        if unknown or not reads:
            raise TypeError(f"reads={reads}: name one or more of {READS}")

        def deco(fn: RuleFn) -> RuleFn:
            self.append(Rule(fn, frozenset(reads), layout_rule))
            return fn

        return deco

    def layout(self, *, reads: tuple[str, ...]) -> Callable[[RuleFn], RuleFn]:
        """A layout rule (checked by convert and verify too)."""
        return self._add(reads, True)

    def run(self, *, reads: tuple[str, ...]) -> Callable[[RuleFn], RuleFn]:
        """A run rule (training, `mbr check`, `mbr plan`)."""
        return self._add(reads, False)


__all__ = ["READS", "Facts", "Rule", "RuleSet", "Violation", "violation"]
