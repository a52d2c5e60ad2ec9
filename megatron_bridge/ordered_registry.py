"""`OrderedRegistry`: classes that register themselves from a declared, ordered module list.

The building blocks' two halves use it — `bridge/features/` (config.json ⇄ spec, core) and
`runtime/blocks/` (the build hooks, runtime): each package lists its modules in the order their
hooks run, each module registers its class with a decorator, and the first call to the
registry imports the whole list (so importing one module directly registers it alone without
stopping the others from loading later) and returns the classes in list order.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=type)


class OrderedRegistry(Generic[T]):
    def __init__(self, package: str, modules: Sequence[str], kind: str) -> None:
        self.package, self.modules, self.kind = package, tuple(modules), kind
        self._classes: list[T] = []
        self._loaded = False

    def register(self, cls: T) -> T:
        if not getattr(cls, "name", ""):
            raise TypeError(f"{cls.__name__}: a {self.kind} needs a name")
        if cls not in self._classes:
            self._classes.append(cls)
        return cls

    def all(self) -> list[T]:
        """Every registered class, in the order of the module list."""
        if not self._loaded:
            for mod in self.modules:
                importlib.import_module(f"{self.package}.{mod}")
            order = {m: i for i, m in enumerate(self.modules)}
            self._classes.sort(key=lambda c: order[c.__module__.rsplit(".", 1)[-1]])
            self._loaded = True
        return list(self._classes)


__all__ = ["OrderedRegistry"]
