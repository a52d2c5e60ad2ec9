"""A converted checkpoint seen as an HF directory's tensors: `keys()` and `slice(name)`.

What a backend that loads from HF tensors (the transformers backend: each rank cuts its shards from the HF
tensors with its table's transforms) reads an `mbr convert` / `mbr reshard` output through, so
a run at any layout loads it by the same code that loads an HF directory. A tensor stored as
rows [0, n) of its torch_dist record (a plain, column-, row- or vocab-split tensor: one HF
tensor per record, the vocabulary padding after it) is sliced lazily, reading only the box a
rank asks for (`DistSlice`); any other (stacked experts, concatenated pieces, every per-rank
file) is put together once per row by the source's own merge, checked against the manifest's
CRC-32 (sources/readers.py).
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bridge.bridge.mapping import NotBlockwise
from megatron_bridge.bridge.shards import FULL
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.sources.readers import CheckpointSource, DistSource, open_checkpoint

if TYPE_CHECKING:
    import torch


class DistSlice:
    """One HF tensor stored as rows [0, n) of a torch_dist record: `.shape`, `.dtype` and
    `[a:b]` / `[a:b, c:d]` reading only that box (what `bridge.shards.assemble` slices)."""

    def __init__(self, reader: DistReader, key: str, shape: tuple[int, ...], dtype: DType):
        self.reader, self.key, self.shape, self._dtype = reader, key, shape, dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype.torch

    def __getitem__(self, idx: slice | tuple[slice, ...]) -> torch.Tensor:
        parts = idx if isinstance(idx, tuple) else (idx,)
        if not 1 <= len(parts) <= len(self.shape) or any(
            not isinstance(p, slice) or p.step not in (None, 1) for p in parts
        ):
            raise TypeError(f"{self.key}: only [a:b] and [a:b, c:d] slices are read lazily, got {idx!r}")
        bounds = [p.indices(n)[:2] for p, n in zip(parts, self.shape)] + [(0, n) for n in self.shape[len(parts) :]]
        lo, hi = tuple(a for a, _ in bounds), tuple(max(a, b) for a, b in bounds)
        return self.reader.read_box(self.key, lo, hi)

    def full(self) -> torch.Tensor:
        return self[0 : self.shape[0]] if self.shape else self.reader.read_box(self.key, (), ())


class ConvertedTensors:
    """The HF tensors of the converted checkpoint at `path` (see the module doc), or of an
    already opened `source` (a Megatron-written checkpoint: `megatron_source`)."""

    def __init__(self, path: Path, source: CheckpointSource | None = None):
        self.path = path
        self.source: CheckpointSource = source if source is not None else open_checkpoint(path, None)
        self._where = {h: (r, i) for r in self.source.rows if r.mapping.export for i, h in enumerate(r.hf)}
        self._held: tuple[str, list[torch.Tensor]] | None = None  # the last merged row's tensors

    def keys(self) -> list[str]:
        return list(self.source.tensors)

    def slice(self, name: str) -> Any:
        row, i = self._where[name]
        lazy = self._lazy(row)
        if lazy is not None:
            return lazy
        if self._held is None or self._held[0] != row.megatron:
            self._held = None
            self._held = (row.megatron, self.source.hf_tensors(row))
        return self._held[1][i]

    def _lazy(self, row: Resolved) -> DistSlice | None:
        """A `DistSlice` of `row`'s one HF tensor where its record holds it as rows [0, n)."""
        src = self.source
        if not isinstance(src, DistSource) or len(row.hf) != 1 or row.mapping.transform.stacked:
            return None
        (name,) = row.hf
        shape, dtype = src.tensors[name]
        try:
            blocks = row.mapping.transform.blocks([shape], FULL, src.shapes)
        except NotBlockwise:
            return None
        first = blocks[0]
        plain = first.src == 0 and first.rows == (0, shape[0]) and first.cols is None and first.step == 1
        if not plain or first.view or first.transposed or any(b.src is not None for b in blocks[1:]):
            return None
        key = src.whole_key(row.megatron)
        if key is None or src.reader.size(key)[1:] != shape[1:] or prod(shape) == 0:
            return None
        return DistSlice(src.reader, key, shape, dtype)

    def close(self) -> None:
        self._held = None
        self.source.close()

    def __enter__(self) -> ConvertedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ConvertedTensors", "DistSlice"]
