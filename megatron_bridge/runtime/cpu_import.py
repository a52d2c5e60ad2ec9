"""`import megatron.core` on a host without CUDA: ~1 s instead of ~5 s (docs/benchmarks.md,
"Start-up"). Every training process, verify worker and test launch pays that import, so on
CPU it was the largest share of a launch's start-up.

Two things take ~4 s of megatron-core's import and are of no use without CUDA:
- megatron decorates its fused kernels (bias+GeLU/SwiGLU, fused dropout-add, some
  activations, the MoE router's expert-bias update) with `torch.compile` at import
  (`megatron.core.jit.jit_fuser`), and building those wrappers imports TorchInductor
  (~3.5 s). On CPU the fusion flags are off (runtime/tconfig.py) and the few decorated
  functions that do run are plain PyTorch: they run eagerly instead, with the same ops.
- megatron.core.inference imports wandb when it is installed (~1.4 s), for inference logging.

`install()` (called by `megatron_bridge/__init__`, so every entry point has it before its
first megatron import, and torch-free itself) puts a finder on `sys.meta_path` that wraps the
execution of `megatron.core`'s package module: on a host without CUDA, `torch.compile` returns
what it is given and `wandb` looks absent while megatron-core's modules import; both are
restored afterwards (our own wandb logger imports it normally). With CUDA, or if megatron.core
was imported before, nothing changes. The CPU shim proper (runtime/cpu.py) patches behaviour;
this only changes what megatron builds at import.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

TARGET = "megatron.core"


def _eager(model: Any = None, **_: Any) -> Any:
    """`torch.compile` as megatron's import sees it without CUDA: the function itself (or, called
    with options only, a decorator returning it)."""
    return model if model is not None else (lambda fn: fn)


@contextlib.contextmanager
def _cpu_import() -> Iterator[None]:
    import torch  # megatron.core's own first import: it is loaded at this point anyway

    if torch.cuda.is_available():
        yield
        return
    real, hid = torch.compile, "wandb" not in sys.modules
    torch.compile = _eager
    if hid:
        sys.modules["wandb"] = None  # type: ignore[assignment]  # `import wandb` raises ImportError
    try:
        yield
    finally:
        torch.compile = real
        if hid and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once: the package module runs once per process
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.abc.Loader):
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            with _cpu_import():
                run(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader
        return spec


def install() -> None:
    """Wrap megatron-core's first import (module docstring); idempotent."""
    if TARGET not in sys.modules and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
