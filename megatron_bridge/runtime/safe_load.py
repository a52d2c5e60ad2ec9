"""`torch.load` of checkpoint files as data only, DeepSpeed's loads included.

`torch_load` is `torch.load(weights_only=True)` — torch's own allowlist of tensors, storages
and plain containers — plus the few extra names of `convert.formats.pickle_guard` the
project's checkpoints hold (NumPy arrays, `argparse.Namespace`, DeepSpeed's plain records).
A file naming anything else is refused by torch before it is called, and the refusal is one
`error:` paragraph naming the file and the object (`pickle_guard.refusal`).

DeepSpeed's `engine.load_checkpoint` loads its files with `torch.load(weights_only=False)`
(its `TorchCheckpointEngine`; ZeRO-3 and the universal checkpoint call `torch.load`
directly). `only_weights()` replaces `torch.load` for the duration of such a call with
`torch_load`, whatever arguments DeepSpeed passes, so a payload in a DeepSpeed file never
reaches an unrestricted unpickler. The trainer's preflight has already scanned those files
with the torch-free `scan_torch_file`, so in practice the refusal comes before any process
group exists; this is the second line.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.convert.formats.pickle_guard import TORCH, Name, refusal

_TORCH_LOAD = torch.load  # the real one: `only_weights` replaces the module attribute for a while
_RENAMED = {"numpy.core.multiarray": "numpy._core.multiarray"}  # NumPy 1's name -> where NumPy 2 keeps it
_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global|Unsupported global: GLOBAL (\S+)")


def _extras(allowed: frozenset[Name]) -> list[Any]:
    """The names of `allowed` beyond torch's own allowlist, as `safe_globals` takes them:
    (object, "module.name"). A module not imported yet (deepspeed in a Megatron-engine run)
    is skipped: its names cannot be in a file this process wrote. With NumPy's names come the
    classes of its numeric dtypes (`numpy.dtypes.UInt32DType`, ...): a pickled dtype is built
    by calling `numpy.dtype` and then given its state, which torch admits only for an
    allowlisted class; they never appear in a pickle by name."""
    out: list[Any] = []
    if ("numpy", "dtype") in allowed:
        import numpy as np

        out += sorted({type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDG"}, key=lambda t: t.__name__)
    for module, name in sorted(allowed - TORCH):
        real = _RENAMED.get(module, module)
        top = real.split(".")[0]
        if top not in sys.modules and top != "numpy" and top != "argparse":
            continue
        try:
            obj = getattr(importlib.import_module(real), name)
        except (ImportError, AttributeError):
            continue
        out.append((obj, f"{module}.{name}"))
    return out


def _what(e: Exception) -> str:
    m = _GLOBAL.search(str(e))
    if m:
        return m.group(1) or m.group(2)
    line = next((ln.strip() for ln in str(e).splitlines() if "WeightsUnpickler error" in ln), str(e).splitlines()[0])
    return line.replace("WeightsUnpickler error: ", "")[:200]


def torch_load(path: str | os.PathLike[str] | Any, allowed: frozenset[Name], **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True, **kwargs)` admitting `allowed` besides torch's own
    names; a file naming anything else: UserError (`pickle_guard.refusal`), nothing run."""
    kwargs.pop("weights_only", None)
    kwargs.pop("pickle_module", None)  # torch refuses a pickle module with weights_only
    with _exactly(_extras(allowed)):
        try:
            return _TORCH_LOAD(path, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            where = path if isinstance(path, str | os.PathLike) else getattr(path, "name", "a checkpoint file")
            raise refusal(Path(where), _what(e)) from None


@contextlib.contextmanager
def _exactly(extras: list[Any]) -> Iterator[None]:
    """torch's allowlist plus `extras` and nothing else for the block: megatron-core adds its
    own classes process-wide at import (`megatron.core.safe_globals`: BytesIO, PosixPath,
    OptimizerConfig, ...), which this project's checkpoints never hold."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(extras)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


@contextlib.contextmanager
def only_weights(allowed: frozenset[Name]) -> Iterator[None]:
    """Inside the block, every `torch.load` is `torch_load(..., allowed)`: for library code
    (DeepSpeed's checkpoint loading) that asks for `weights_only=False`."""

    def load(f: Any, map_location: Any = None, pickle_module: Any = None, **kwargs: Any) -> Any:
        return torch_load(f, allowed, map_location=map_location, **kwargs)

    torch.load = load  # deliberate: DeepSpeed calls torch.load itself
    try:
        yield
    finally:
        torch.load = _TORCH_LOAD


__all__ = ["only_weights", "torch_load"]
