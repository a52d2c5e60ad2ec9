"""A safetensors file written tensor by tensor, byte-identical to `safetensors.torch.save_file`.

Why: `export_hf_weights` used to collect a whole pipeline stage's full tensors in host memory
and hand them to `save_file` at once (a 70B model at pp4 is ~35 GB on one rank). The format puts
a header with every tensor's offset first and orders the data by (dtype descending, name), which
is only known once the last tensor has arrived; so each tensor is appended, in arrival order, to
a spill file next to the target as soon as it is gathered, and `finish` writes the header and
copies the spill's ranges in the library's order through a bounded buffer (the header and byte
views are the converter's: convert/formats/safetensors_io.py). Host memory: the one
tensor being appended plus `COPY_BUFFER` bytes; disk: the spill, removed when the file is done.
`tests/unit/runtime/test_safetensors_stream.py` holds the byte-for-byte comparison with
`save_file` that keeps the header and order below honest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_bridge.convert.formats.dtypes import BY_ST, dtype_of
from megatron_bridge.convert.formats.safetensors_io import SafetensorsWriter, tensor_bytes

COPY_BUFFER = 64 << 20  # bytes moved per read/write when the spill is copied into the file

# safetensors' dtype codes in the library's `Dtype` declaration order: `save_file` orders the
# data by this order descending, then by name (safetensors/src/tensor.rs, `prepare`)
SAVE_FILE_ORDER = (
    *("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16"),
    *("I32", "U32", "F32", "F64", "I64", "U64"),
)
_RANK = {code: i for i, code in enumerate(SAVE_FILE_ORDER)}


def save_file_key(st_dtype: str, name: str) -> tuple[int, str]:
    """Where `save_file` puts a tensor's data: by dtype code descending, then by name."""
    return -_RANK[st_dtype], name


@dataclass(frozen=True)
class Entry:
    """One tensor appended to the spill: where its bytes are and what the header says of it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the spill
    nbytes: int


class StreamingSafetensors:
    """`add(name, tensor)` per tensor, then `finish(path)` once; or `discard()` on failure."""

    def __init__(self, spill: Path) -> None:
        self.spill = spill
        self.entries: dict[str, Entry] = {}
        self._file = open(spill, "wb")  # noqa: SIM115 - held open across add() calls, closed in finish/discard
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Append one tensor's bytes (moved to host here; nothing else is kept)."""
        if name in self.entries:
            raise RuntimeError(f"{name} added twice to {self.spill}")
        t = tensor.detach().to("cpu")
        raw = tensor_bytes(t)
        self._file.write(raw)
        self.entries[name] = Entry(name, dtype_of(t.dtype).st, tuple(t.shape), self._offset, raw.nbytes)
        self._offset += raw.nbytes

    def sizes(self) -> list[tuple[str, int]]:
        """(name, bytes) of every tensor added, by name: what the index needs."""
        return sorted((e.name, e.nbytes) for e in self.entries.values())

    def finish(self, path: Path, metadata: dict[str, str] | None = None) -> None:
        """Write `path` as `save_file(tensors, path, metadata)` would (the header by the
        converter's `SafetensorsWriter`), then remove the spill."""
        self._file.close()
        order = sorted(self.entries.values(), key=lambda e: save_file_key(e.dtype, e.name))
        out = SafetensorsWriter(path, [(e.name, BY_ST[e.dtype], e.shape) for e in order], metadata)
        with open(self.spill, "rb") as src:
            for e in order:
                fd, at = out.reserve(e.name)
                src.seek(e.offset)
                for done in range(0, e.nbytes, COPY_BUFFER):
                    os.pwrite(fd, src.read(min(COPY_BUFFER, e.nbytes - done)), at + done)
        out.close()
        self.spill.unlink()

    def discard(self) -> None:
        """Close and remove the spill (an export that failed part-way)."""
        self._file.close()
        self.spill.unlink(missing_ok=True)


__all__ = ["COPY_BUFFER", "SAVE_FILE_ORDER", "Entry", "StreamingSafetensors", "save_file_key"]
