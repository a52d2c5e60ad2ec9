"""Tensor dtypes without importing torch.

A conversion from HF safetensors is byte moves plus a few small pickles; `import torch`
alone costs the same order of time as copying a 1.7 GB model (docs/benchmarks.md). So the
converter's tables (safetensors headers, manifests, the `dtype=` option) hold these `DType`s
instead of `torch.dtype`s, and only code that builds real tensors asks for `.torch`.

A `DType` compares equal to the torch dtype of the same name (either side of `==`), prints
like one (`torch.bfloat16`), and has the attributes the converter reads (`itemsize`,
`is_floating_point`). It does not hash like one: don't mix the two as dict keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class DType:
    name: str  # torch's attribute name: "bfloat16"
    st: str  # safetensors' code: "BF16"
    itemsize: int
    is_floating_point: bool

    @property
    def torch(self) -> Any:
        import torch

        return getattr(torch, self.name)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return self.name == other.name
        return str(other) == str(self)  # a torch.dtype prints as torch.<name>

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__


_ALL = [
    DType("float64", "F64", 8, True),
    DType("float32", "F32", 4, True),
    DType("float16", "F16", 2, True),
    DType("bfloat16", "BF16", 2, True),
    DType("int64", "I64", 8, False),
    DType("int32", "I32", 4, False),
    DType("int16", "I16", 2, False),
    DType("int8", "I8", 1, False),
    DType("uint8", "U8", 1, False),
    DType("bool", "BOOL", 1, False),
    DType("float8_e4m3fn", "F8_E4M3", 1, True),  # fp8 block-quantised weights (formats/fp8.py)
]
BY_ST: dict[str, DType] = {d.st: d for d in _ALL}
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BFLOAT16, FLOAT32, FLOAT16 = BY_NAME["bfloat16"], BY_NAME["float32"], BY_NAME["float16"]


def dtype_of(d: Any) -> DType:
    """The DType of a torch.dtype (or a DType)."""
    return d if isinstance(d, DType) else BY_NAME[str(d).replace("torch.", "")]


__all__ = ["DType", "BY_ST", "BY_NAME", "BFLOAT16", "FLOAT32", "FLOAT16", "dtype_of"]
