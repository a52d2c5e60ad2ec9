"""torch_dist checkpoints read back without torch (the format: `dist_ckpt`).

DCP's `.metadata` is a pickle of `torch.distributed.checkpoint` dataclasses; it is loaded
into the `Record` stand-ins below by an unpickler that allows exactly the globals such a
file names, so finding a chunk's file, offset and length needs neither torch nor
`torch.distributed.checkpoint` (~2 s of imports). Only the methods that build tensors
import torch. The reader assembles any box of a global tensor from any chunking: one chunk
per layer as `mbr convert` writes it, or megatron-core's own TP-split or stacked chunks.

The one torch_dist reader: export and reshard read whole tensors with it, and
`train.init_from` (`runtime/load_converted.py`) each rank's shards, reading only the bytes
those span; objects are unpickled by an allowlist, never by `torch.load(weights_only=False)`.
"""

from __future__ import annotations

import json
import pickle
import re
from collections import OrderedDict
from collections.abc import Sequence
from math import prod
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple

from megatron_bridge.convert.formats.dist_ckpt import DCP, PLANNER, DistLocation
from megatron_bridge.convert.formats.dtypes import BY_NAME, DType
from megatron_bridge.convert.formats.paths import confined, require_regular
from megatron_bridge.convert.formats.pickle_guard import Refused, refusal
from megatron_bridge.convert.formats.pickling import Record
from megatron_bridge.convert.formats.safetensors_io import PositionedReader
from megatron_bridge.convert.formats.torch_zip import TensorRef
from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: the byte paths never import it
    import torch


class _Metadata(Record):
    """DCP's `Metadata`: `state_dict_metadata` (key -> tensor or bytes entry) and
    `storage_data` (MetadataIndex -> _StorageInfo)."""

    state_dict_metadata = planner_data = storage_data = storage_meta = version = None


class _TensorEntry(Record):
    """`TensorStorageMetadata`: `properties`, the global `size`, `chunks`."""

    properties: _Properties
    size: tuple[int, ...]
    chunks: list[_Chunk]


class _Chunk(Record):
    """`ChunkStorageMetadata`: `offsets` and `sizes` (tuples: torch.Size loads as one)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class _Properties(Record):
    """`TensorProperties`, whose `__getstate__` pickles a tuple (with the memory format as an
    enum, torch.memory_format being unpicklable) instead of a `__dict__`."""

    dtype: DType
    layout: str
    requires_grad: bool
    memory_format: int
    pin_memory: bool

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class _Index(Record):
    """`MetadataIndex`: `fqn`, the chunk's `offset` (None for an object), `index` (a hint)."""

    offset = index = None


class _StorageInfo(Record):
    """`_StorageInfo`: `relative_path`, `offset`, `length`. Its `__getstate__` leaves out
    None fields, so `transform_descriptors` is often absent."""

    relative_path: str
    offset: int
    length: int

    transform_descriptors = None


# Every global a DCP `.metadata` names (besides dtypes), and the stand-in each loads as.
_ALLOWED: dict[tuple[str, str], Any] = {
    (DCP, "Metadata"): _Metadata,
    (DCP, "TensorStorageMetadata"): _TensorEntry,
    (DCP, "ChunkStorageMetadata"): _Chunk,
    (DCP, "TensorProperties"): _Properties,
    (DCP, "MetadataIndex"): _Index,
    (DCP, "BytesStorageMetadata"): Record,
    (DCP, "StorageMeta"): Record,
    (DCP, "_MEM_FORMAT_ENCODING"): int,  # an Enum pickles as cls(value)
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): str,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): PurePosixPath,  # StorageMeta.checkpoint_id as torch's FileSystemWriter sets it
    # megatron-core's save keeps the gathered save plans (`Metadata.all_local_plans`) to reuse them
    (PLANNER, "SavePlan"): Record,
    (PLANNER, "WriteItem"): Record,
    (PLANNER, "WriteItemType"): int,
    (PLANNER, "TensorWriteData"): Record,
    (PLANNER, "BytesIOWriteData"): Record,
}
_TORCH_DTYPE = re.compile(r"(b?float|complex|q?u?int|bits)\d\w*")  # float8_e4m3fn, quint4x2, uint16, ...


class _MetadataUnpickler(pickle.Unpickler):
    """Loads `.metadata` into the stand-ins above, dtypes as `DType`s. Any other global is
    refused before it is called: unpickling calls whatever a pickle names."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in BY_NAME:
            return BY_NAME[name]
        if module == "torch" and _TORCH_DTYPE.fullmatch(name):
            raise pickle.UnpicklingError(f"unsupported dtype torch.{name}")
        if (module, name) not in _ALLOWED:
            raise Refused(module, name)
        return _ALLOWED[(module, name)]


class ChunkRegion(NamedTuple):
    """A chunk's torch.save item inside a `.distcp` file, and the tensor stored in it."""

    path: Path
    offset: int
    length: int
    shape: tuple[int, ...]  # as stored: unit layer/expert axes first
    dtype: DType


class DistReader:
    """Reads any region of a key back, assembling it from whichever chunks cover it (our own
    checkpoints have one chunk per layer; megatron-written ones may be split by TP).

    Finding chunks needs no torch (the metadata loads into stand-ins); only `read`, which
    builds tensors, imports it."""

    def __init__(self, directory: Path, reader: PositionedReader, prefix: str = ""):
        """`prefix`: of every key the checkpoint stores (NeMo 2 saves megatron-core's keys
        under `module.`); keys are read without it, and keys outside it are not seen."""
        self.dir, self._io = directory, reader
        try:
            for name in ("metadata.json", ".metadata"):
                require_regular(directory / name)
            meta = json.loads((directory / "metadata.json").read_text())
            if meta.get("sharded_backend") != "torch_dist":
                raise ValueError(f"sharded_backend {meta.get('sharded_backend')!r}")
            with open(directory / ".metadata", "rb") as f:
                self.md = _MetadataUnpickler(f).load()
            if not (
                isinstance(self.md, _Metadata)
                and isinstance(self.md.state_dict_metadata, dict)
                and isinstance(self.md.storage_data, dict)
            ):
                raise ValueError(".metadata does not hold DCP's Metadata")
            if prefix:
                self.md.state_dict_metadata = {
                    k[len(prefix) :]: v for k, v in self.md.state_dict_metadata.items() if k.startswith(prefix)
                }
            # what MetadataIndex's hash and equality look at: the key and the chunk's offsets
            self._storage: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {
                (i.fqn[len(prefix) :], tuple(i.offset or ())): info
                for i, info in self.md.storage_data.items()
                if i.fqn.startswith(prefix)
            }
        except Refused as e:
            raise refusal(directory / ".metadata", e.what) from None
        # a damaged pickle can fail with any of these
        except (
            OSError,
            ValueError,
            TypeError,
            AttributeError,
            KeyError,
            IndexError,
            EOFError,
            pickle.UnpicklingError,
        ) as e:
            raise UserError(f"{directory}: not a readable torch_dist checkpoint ({e})") from None
        # the chunk files `.metadata` names: inside the directory, regular files (nothing opened yet)
        for path in sorted({getattr(info, "relative_path", None) for info in self._storage.values()}, key=str):
            confined(directory, path, source=directory / ".metadata", what="chunk file")

    def _item(self, key: str, chunk: _Chunk) -> _StorageInfo:
        info = self._storage.get((key, tuple(chunk.offsets)))
        if info is None:
            raise UserError(f"{self.dir}: no storage entry for the chunk of {key} at {tuple(chunk.offsets)} (damaged)")
        if info.transform_descriptors:
            raise UserError(f"{self.dir}: {key} is stored with transforms {info.transform_descriptors} (unsupported)")
        return info

    def _entry(self, key: str) -> _TensorEntry:
        tmd = self.md.state_dict_metadata.get(key)
        if not isinstance(tmd, _TensorEntry):
            raise UserError(f"{self.dir}: the checkpoint has no tensor {key}")
        return tmd

    def keys(self) -> list[str]:
        """Every stored key (tensors and objects)."""
        return list(self.md.state_dict_metadata)

    def is_tensor(self, key: str) -> bool:
        return isinstance(self.md.state_dict_metadata.get(key), _TensorEntry)

    def dtype(self, key: str) -> DType:
        """The stored dtype of tensor `key`."""
        return self._entry(key).properties.dtype

    def size(self, key: str) -> tuple[int, ...]:
        """The global shape of tensor `key`."""
        return tuple(self._entry(key).size)

    def _region(self, loc: DistLocation) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The box of `loc` in its key's global tensor: one index on each leading axis, all of the rest."""
        size = self._entry(loc.key).size
        n = len(loc.offsets)
        return loc.offsets + (0,) * (len(size) - n), tuple(o + 1 for o in loc.offsets) + tuple(size[n:])

    def _covering(self, key: str, lo: Sequence[int], hi: Sequence[int]) -> list[tuple[_Chunk, tuple, tuple]]:
        """[(chunk, overlap lo, overlap hi)] of the chunks of `key` that meet the box [lo, hi)."""
        hits = []
        for c in self._entry(key).chunks:
            a = tuple(max(x, y) for x, y in zip(lo, c.offsets))
            b = tuple(min(x, o + s) for x, o, s in zip(hi, c.offsets, c.sizes))
            if all(x < y for x, y in zip(a, b)):
                hits.append((c, a, b))
        return hits

    def ranges(self, loc: DistLocation) -> list[tuple[Path, int, int]]:
        try:
            hits = self._covering(loc.key, *self._region(loc))
        except UserError:
            return []
        infos = [self._storage.get((loc.key, tuple(c.offsets))) for c, _, _ in hits]
        return [(self.dir / i.relative_path, i.offset, i.length) for i in infos if i is not None]

    def single_chunk(self, loc: DistLocation) -> ChunkRegion | None:
        """The item holding exactly the region of `loc`, when one chunk is that region (always
        so in our own checkpoints), for moving its bytes; None when the region takes several
        chunks or a part of one (megatron's TP-split or stacked chunks): `read` assembles those."""
        lo, hi = self._region(loc)
        hits = self._covering(loc.key, lo, hi)
        c = hits[0][0] if len(hits) == 1 else None
        if c is None or (tuple(c.offsets), tuple(o + s for o, s in zip(c.offsets, c.sizes))) != (lo, hi):
            return None
        info = self._item(loc.key, c)
        return ChunkRegion(
            self.dir / info.relative_path,
            info.offset,
            info.length,
            tuple(c.sizes),
            self._entry(loc.key).properties.dtype,
        )

    def read(self, loc: DistLocation) -> torch.Tensor:
        """The tensor at `loc` (its leading layer/expert axes dropped)."""
        lo, hi = self._region(loc)
        return self.read_box(loc.key, lo, hi).reshape(self.size(loc.key)[len(loc.offsets) :])

    def read_box(self, key: str, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
        """The box [lo, hi) of global tensor `key`, put together from the chunks that cover it;
        of each chunk only the bytes spanning its part of the box are read
        (`LazyTorchFile.read_box`), so a rank loading its shard reads about its share."""
        import torch

        lo, hi = tuple(lo), tuple(hi)
        tmd = self._entry(key)
        shape = tuple(b - a for a, b in zip(lo, hi))
        if len(shape) != len(tmd.size) or not all(0 <= a <= b <= n for a, b, n in zip(lo, hi, tmd.size)):
            raise UserError(f"{self.dir}: {key} has shape {list(tmd.size)}, no box {list(lo)}..{list(hi)}")
        if prod(shape) == 0:
            return torch.empty(shape, dtype=tmd.properties.dtype.torch)
        out, filled = None, 0
        for c, a, b in self._covering(key, lo, hi):
            part = self._chunk_box(key, c, a, b)
            if (a, b) == (lo, hi):
                return part
            if out is None:
                out = torch.empty(shape, dtype=part.dtype)
            out[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))] = part
            filled += prod(y - x for x, y in zip(a, b))
        if out is None or filled != out.numel():
            raise UserError(f"{self.dir}: the chunks of {key} do not cover {list(lo)}..{list(hi)} (incomplete)")
        return out

    def _chunk_box(self, key: str, chunk: _Chunk, lo: tuple[int, ...], hi: tuple[int, ...]) -> torch.Tensor:
        """The part [lo, hi) (global coordinates) of one chunk."""
        info = self._item(key, chunk)
        item = LazyTorchFile(self.dir / info.relative_path, self._io, info.offset, info.length)
        ref = item.obj
        if not isinstance(ref, TensorRef) or ref.shape != tuple(chunk.sizes):
            raise UserError(f"{self.dir}: the chunk of {key} at {tuple(chunk.offsets)} is not its tensor (damaged)")
        at = tuple(chunk.offsets)
        return item.read_box(ref, [x - o for x, o in zip(lo, at)], [y - o for y, o in zip(hi, at)])

    def scan_objects(self) -> None:
        """Check every stored object (megatron's `_extra_state` and other ShardedObjects)
        before anything loads: UserError (`pickle_guard.refusal`) if one names anything but
        data. Reads only those items, builds nothing."""
        for key, entry in self.md.state_dict_metadata.items():
            info = self._storage.get((key, ()))
            if type(entry) is Record and info is not None:  # BytesStorageMetadata
                LazyTorchFile(self.dir / info.relative_path, self._io, info.offset, info.length)

    def read_object(self, key: str) -> Any:
        """A stored object (megatron's ShardedObject, e.g. a linear layer's `_extra_state`),
        unpickled by the allowlisting reader (torch's DCP would `torch.load` it with
        weights_only=False): megatron stores `[value]`, this returns `value`."""
        info = self._storage.get((key, ()))
        if type(self.md.state_dict_metadata.get(key)) is not Record or info is None:  # BytesStorageMetadata
            raise UserError(f"{self.dir}: the checkpoint has no object {key}")
        obj = LazyTorchFile(self.dir / info.relative_path, self._io, info.offset, info.length).obj
        if not (isinstance(obj, list) and len(obj) == 1) or isinstance(obj[0], TensorRef):
            raise UserError(f"{self.dir}: object {key} is not a stored value (unsupported: {type(obj).__name__})")
        return obj[0]


__all__ = ["DistReader", "ChunkRegion"]
