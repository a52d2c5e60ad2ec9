"""A checkpoint is data, never code: what a checkpoint's pickles may name, and the refusal.

A pickle is a small program: loading one calls every global it names (a class, a function)
with arguments it supplies, so `torch.load(weights_only=False)` of a stranger's file runs
whatever the stranger chose (`os.system`, `builtins.exec`, ...). Every load of a checkpoint
in this project therefore goes through an allowlist of globals:

* the torch-free readers (`torch_zip_read`, `dist_read`) unpickle with stand-ins for the
  allowed names and refuse any other name before it is called;
* the runtime loads with `torch.load(weights_only=True)` plus the extra names below
  (`runtime/safe_load.py`), DeepSpeed's own loads included;
* `scan` checks a file without building anything: every allowed name loads as an inert
  stand-in, so the scan runs no code even for a name that is allowed. The trainer's preflight
  and `mbr check-ckpt` scan a training checkpoint's files this way.

The allowed names are tensors, storages, dtypes and plain containers (what torch's own
`weights_only` loader accepts), plus what the project's own checkpoints hold besides:
NumPy arrays (the NumPy RNG state of a training checkpoint), `argparse.Namespace` (the
`args` of a Megatron per-rank file) and DeepSpeed's few plain records (loss scaler, ZeRO
stage enum, fragment addresses). None of them runs anything but its own constructor.
"""

from __future__ import annotations

import _compat_pickle
import pickle
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from megatron_bridge.errors import UserError

Name = tuple[str, str]  # (module, qualified name), as a pickle's GLOBAL opcode names it

_TORCH_MODULES = ("torch", "torch.cuda", "torch.sparse", "torch.cuda.sparse")
# storages and legacy tensor types (FloatStorage, cuda.HalfTensor), dtypes, quantization schemes
_TORCH_NAME = re.compile(r"\w+Storage|\w*Tensor|Size|device|(b?float|complex|q?u?int|bits)\w*|bool|per_\w+")
TORCH: frozenset[Name] = frozenset(
    {
        ("torch._utils", f"_rebuild_{kind}")
        for kind in (
            "tensor",
            "tensor_v2",
            "tensor_v3",
            "parameter",
            "parameter_with_state",
            "qtensor",
            "sparse_tensor",
            "nested_tensor",
            "meta_tensor_no_storage",
            "wrapper_subclass",
            "device_tensor_from_cpu_tensor",
            "device_tensor_from_numpy",
        )
    }
    | {
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch.nn.parameter", "Parameter"),
        ("torch.storage", "TypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("collections", "Counter"),
        ("builtins", "set"),
        ("builtins", "bytearray"),
        ("builtins", "complex"),
        ("_codecs", "encode"),  # how protocol 2 stores bytes
    }
)
NUMPY: frozenset[Name] = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),  # NumPy 1 names it so, NumPy 2 as below
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }
)
ARGPARSE: frozenset[Name] = frozenset({("argparse", "Namespace")})
DEEPSPEED: frozenset[Name] = frozenset(
    {
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
    }
)
# What megatron-core itself allows when it loads a checkpoint (`megatron.core.safe_globals`):
# the `args` Megatron-LM stores (a Namespace holding dtypes and megatron's enums), its RNG and
# rerun-state records, `_extra_state` as BytesIO, and the `bytes` of protocol-2 pickles
# (`_codecs.encode(text, "latin1")`, as torch's own weights-only loader admits). Each is a
# plain record, an enum value or that one conversion.
MEGATRON_RECORDS: frozenset[Name] = frozenset(
    {
        ("argparse", "Namespace"),
        ("types", "SimpleNamespace"),
        ("pathlib", "PosixPath"),
        ("io", "BytesIO"),
        ("_io", "BytesIO"),
        ("_codecs", "encode"),
        ("signal", "Signals"),
        ("numpy.dtypes", "UInt32DType"),
        ("megatron.core.enums", "ModelType"),
        ("megatron.core.transformer.enums", "AttnBackend"),
        ("megatron.core.transformer.enums", "CudaGraphScope"),
        ("megatron.core.optimizer.optimizer_config", "OptimizerConfig"),
        ("megatron.core.rerun_state_machine", "RerunDiagnostic"),
        ("megatron.core.rerun_state_machine", "RerunMode"),
        ("megatron.core.rerun_state_machine", "RerunState"),
    }
)
TRAINING = TORCH | NUMPY | DEEPSPEED
"""What the files of a training checkpoint (`checkpoint.dir`) may name: this project's rank
files (model, optimizer, scheduler, RNG states) and DeepSpeed's model and ZeRO files."""
CONVERTED = TORCH | ARGPARSE
"""What the files of an `mbr convert` output may name (Megatron's per-rank files carry `args`)."""
MEGATRON = TORCH | NUMPY | MEGATRON_RECORDS
"""What a checkpoint written by Megatron-LM, NeMo or Megatron-Bridge may name (`common.pt`, the
per-rank `model_optim_rng.pt`): exactly the names megatron-core's own loader admits."""


def allows(allowed: frozenset[Name], module: str, name: str) -> bool:
    """Whether `allowed` admits the global `module.name` (torch's storages, legacy tensor
    types and dtypes by pattern, everything else by exact name)."""
    if (module, name) in allowed:
        return True
    torch_too = ("torch._utils", "_rebuild_tensor_v2") in allowed  # the allowlist includes TORCH
    return torch_too and module in _TORCH_MODULES and _TORCH_NAME.fullmatch(name) is not None


def python3_name(module: str, name: str) -> tuple[str, str]:
    """A Python 2 name (`__builtin__.set`, which protocol 2 pickles such as torch.save's
    write) as Python 3's unpickler resolves it (`_compat_pickle`, as `pickle.Unpickler.find_class`)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


class Refused(pickle.UnpicklingError):
    """A pickle names a global outside the allowlist; `what` is `module.name`."""

    def __init__(self, module: str, name: str):
        self.what = f"{module}.{name}"
        super().__init__(f"refused global {self.what}")


def refusal(where: str | Path, what: str) -> UserError:
    """The one message for a checkpoint file that holds something other than data."""
    return UserError(
        f"{where} was refused: it holds a `{what}` object, and loading it would call `{what}` "
        "(unpickling runs whatever a pickle names, so a checkpoint can carry code). Checkpoints "
        "are loaded as data only — tensors, numbers, strings and plain containers — and nothing "
        "of this one was loaded or run. Fix: use a checkpoint from a source you trust; if it is "
        "yours, load it once in a trusted session and save its tensors again (torch.save of a "
        "state_dict, or safetensors)."
    )


class _Inert:
    """What an allowed name loads as in a scan: accepts any construction, state and items,
    and does nothing, so a scan builds no real object (and calls no constructor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __new__(cls, *args: Any, **kwargs: Any) -> _Inert:
        return object.__new__(cls)

    def __call__(self, *args: Any, **kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Iterable[Any]) -> None:
        pass


class ScanUnpickler(pickle.Unpickler):
    """Walks a pickle with `_Inert` stand-ins for the allowed globals; raises `Refused` for
    any other. Persistent ids (torch's storages) load as None."""

    def __init__(self, file: Any, allowed: frozenset[Name]):
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Callable[..., Any]:
        module, name = python3_name(module, name)
        if not allows(self._allowed, module, name):
            raise Refused(module, name)
        return _Inert

    def persistent_load(self, pid: Any) -> None:
        return None


__all__ = [
    "ARGPARSE",
    "CONVERTED",
    "DEEPSPEED",
    "MEGATRON",
    "MEGATRON_RECORDS",
    "NUMPY",
    "TORCH",
    "TRAINING",
    "Refused",
    "ScanUnpickler",
    "allows",
    "python3_name",
    "refusal",
]
