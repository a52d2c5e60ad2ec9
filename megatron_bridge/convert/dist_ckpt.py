"""megatron-core `dist_checkpointing` ("torch_dist") checkpoints, written and read offline.

The format is PyTorch Distributed Checkpoint (DCP) plus two megatron files:
`metadata.json` (which backends) and `common.pt` (the non-tensor state). In the DCP part,
`.metadata` is a pickled `torch.distributed.checkpoint.metadata.Metadata` (per key: global
shape, dtype, chunk list; per chunk: file, byte offset, length) and each chunk is one
`torch.save`d tensor inside a `.distcp` file. Keys, global shapes and chunking are those of
`GPTModel.sharded_state_dict()`:

* layers of a homogeneous stack share a key with a leading layer axis,
  `decoder.layers.<name>` of shape [L, ...] (one chunk per layer — one stacked chunk loads
  several times slower); with MoE and dense layers mixed, keys keep the layer index
  (`decoder.layers.<i>.<name>`), as megatron does for non-homogeneous stacks;
* experts add an expert axis: `...mlp.experts.experts.linear_fc1.weight` [L, E, ...];
* norms use the local spec's fused names (`bridge.layout.dist_ckpt_key`);
* every linear layer in a layer has an `_extra_state` ShardedObject (value None), which a
  strict load expects.

megatron's own `dist_checkpointing.save` needs every tensor in memory at once and a process
group; writing the same files directly streams one chunk at a time. The data is global
(full tensors, world size 1), so megatron-core reshards it on load to any TP/PP/EP.

Neither side imports torch for the metadata: `.metadata` is written from `pickling`'s
stand-ins and read back into the `Record`s below, so export can find a chunk's bytes and
move them without importing torch or `torch.distributed.checkpoint` (docs/benchmarks.md).
"""

from __future__ import annotations

import json
import pickle
import re
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, NamedTuple

from megatron_bridge.bridge.hf_config import BridgeSpec
from megatron_bridge.bridge.layout import dist_ckpt_key
from megatron_bridge.convert.dtypes import BY_NAME, DType, dtype_of
from megatron_bridge.convert.pickling import Global, Instance, Record, Reduce, TorchPickler, torch_size
from megatron_bridge.convert.placement import LINEAR_MODULES
from megatron_bridge.convert.safetensors_io import PositionedReader
from megatron_bridge.convert.torch_zip import LazyTorchFile, StreamingTorchSave
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: the byte paths never import it
    import torch

DATA_FILE = "__0_0.distcp"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (a test holds them equal)
_DCP = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_STRIDED = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))  # how torch pickles a layout
_CONTIGUOUS = Reduce(Global(_DCP, "_MEM_FORMAT_ENCODING"), (0,))  # TensorProperties' memory_format
MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.experts)\.local_experts\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class DistLocation:
    """Key of a parameter in the checkpoint, and its position on the prepended axes."""

    key: str
    offsets: tuple[int, ...] = ()  # (layer[, expert]) index
    axes: tuple[int, ...] = ()  # (L[, E]) sizes

    @property
    def object_key(self) -> str:
        """ShardedObject.unique_key of an `_extra_state` at this location."""
        offs, axes = self.offsets or (0,), self.axes or (1,)
        return f"{self.key}/shard_{'.'.join(map(str, offs))}_{'.'.join(map(str, axes))}"


def location(name: str, spec: BridgeSpec) -> DistLocation:
    """Where global megatron parameter `name` is stored."""
    name = dist_ckpt_key(name)
    m = _LAYER.match(name)
    if not m:
        return DistLocation(name)
    layer, rest = int(m.group(1)), m.group(2)
    stacked = not spec.moe_layer_pattern  # megatron: moe_layer_freq as a list -> non-homogeneous layers
    key = "decoder.layers." if stacked else f"decoder.layers.{layer}."
    offsets, axes = ((layer,), (spec.num_layers,)) if stacked else ((), ())
    e = _EXPERT.match(rest)
    if e:
        rest = f"{e.group(1)}.experts.{e.group(3)}"
        offsets, axes = offsets + (int(e.group(2)),), axes + (spec.num_moe_experts,)
    return DistLocation(key + rest, offsets, axes)


def extra_state_location(name: str, spec: BridgeSpec) -> DistLocation | None:
    """The `_extra_state` object that goes with a linear layer's weight (inside the layers)."""
    module, _, leaf = name.rpartition(".")
    if leaf != "weight" or module.rsplit(".", 1)[-1] not in LINEAR_MODULES or not _LAYER.match(name):
        return None
    return location(f"{module}._extra_state", spec)


class DistWriter:
    """Streams chunks into one `.distcp` file; `finish` writes the metadata that indexes them.

    No torch: each chunk is a `StreamingTorchSave` archive, and `.metadata` is the pickle of
    DCP's `Metadata` written from stand-ins (`pickling`) — the real classes live in
    `torch.distributed.checkpoint`, an import that costs more on top of torch's."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.path = directory / DATA_FILE
        self._f = open(self.path, "wb")
        # key -> (dtype, global size, [(chunk offsets, chunk sizes)]), or None for an object
        self._md: dict[str, tuple[DType, tuple[int, ...], list[tuple[tuple[int, ...], ...]]] | None] = {}
        self._storage: list[tuple[str, tuple[int, ...] | None, int | None, int, int]] = []

    def _write(
        self, key: str, offsets: tuple[int, ...] | None, index: int | None, fill: Callable[[StreamingTorchSave], Any]
    ) -> None:
        start = self._f.tell()
        item = StreamingTorchSave(self._f)
        item.finish(fill(item))
        self._storage.append((key, offsets, index, start, self._f.tell() - start))

    def add(
        self,
        loc: DistLocation,
        dtype: Any,
        shape: tuple[int, ...],
        fill: Callable[[StreamingTorchSave, tuple[int, ...]], Any],
    ) -> None:
        """One chunk: the tensor of `shape` at `loc`; `fill(item, stored_shape)` writes it into
        the item (a record of `stored_shape` = unit axes for the layer/expert + `shape`)
        and returns its TensorRef."""
        dtype = dtype_of(dtype)
        size = loc.axes + tuple(shape)
        offsets = loc.offsets + (0,) * len(shape)
        stored = (1,) * len(loc.offsets) + tuple(shape)
        md = self._md.setdefault(loc.key, (dtype, size, []))
        if md is None or md[1] != size or md[0] != dtype:
            raise RuntimeError(f"{loc.key}: chunk {size} {dtype} does not match {md and md[1]} {md and md[0]}")
        md[2].append((offsets, stored))
        self._write(loc.key, offsets, len(md[2]) - 1, lambda item: fill(item, stored))

    def add_object(self, loc: DistLocation, value: Any = None) -> None:
        self._md[loc.object_key] = None
        self._write(loc.object_key, None, None, lambda item: [value])  # megatron's torch.save([data])

    def _metadata(self) -> Instance:
        def chunk(offsets, sizes):
            return Instance(_DCP, "ChunkStorageMetadata", {"offsets": torch_size(offsets), "sizes": torch_size(sizes)})

        entries: dict[str, Instance] = {}
        for key, md in self._md.items():
            if md is None:
                entries[key] = Instance(_DCP, "BytesStorageMetadata", {})
                continue
            dtype, size, chunks = md
            props = Instance(_DCP, "TensorProperties", (dtype, _STRIDED, False, _CONTIGUOUS, False))
            entries[key] = Instance(
                _DCP,
                "TensorStorageMetadata",
                {"properties": props, "size": torch_size(size), "chunks": [chunk(o, s) for o, s in chunks]},
            )
        storage = {}
        for key, offsets, index, start, length in self._storage:
            where = Instance(
                _DCP,
                "MetadataIndex",
                {"fqn": key, "offset": None if offsets is None else torch_size(offsets), "index": index},
            )
            storage[where] = Instance(
                "torch.distributed.checkpoint.filesystem",
                "_StorageInfo",
                {"relative_path": DATA_FILE, "offset": start, "length": length},
            )
        meta = Instance(
            _DCP, "StorageMeta", {"checkpoint_id": None, "save_id": str(uuid.uuid4()), "load_id": None, "modules": []}
        )
        return Instance(
            _DCP,
            "Metadata",
            {
                "state_dict_metadata": entries,
                "planner_data": None,
                "storage_data": storage,
                "storage_meta": meta,
                "version": DCP_VERSION,
            },
        )

    def finish(self, common: dict[str, Any]) -> None:
        self._f.close()
        with open(self.dir / ".metadata", "wb") as f:
            TorchPickler(f).dump(self._metadata())
        StreamingTorchSave(self.dir / "common.pt").finish(common)
        (self.dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


class _Metadata(Record):
    """DCP's `Metadata`: `state_dict_metadata` (key -> tensor or bytes entry) and
    `storage_data` (MetadataIndex -> _StorageInfo)."""

    state_dict_metadata = planner_data = storage_data = storage_meta = version = None


class _TensorEntry(Record):
    """`TensorStorageMetadata`: `properties`, the global `size`, `chunks`."""


class _Chunk(Record):
    """`ChunkStorageMetadata`: `offsets` and `sizes` (tuples: torch.Size loads as one)."""


class _Properties(Record):
    """`TensorProperties`, whose `__getstate__` pickles a tuple (with the memory format as an
    enum, torch.memory_format being unpicklable) instead of a `__dict__`."""

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


class _Index(Record):
    """`MetadataIndex`: `fqn`, the chunk's `offset` (None for an object), `index` (a hint)."""

    offset = index = None


class _StorageInfo(Record):
    """`_StorageInfo`: `relative_path`, `offset`, `length`. Its `__getstate__` leaves out
    None fields, so `transform_descriptors` is often absent."""

    transform_descriptors = None


# Every global a DCP `.metadata` names (besides dtypes), and the stand-in each loads as.
_ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): _Metadata,
    (_DCP, "TensorStorageMetadata"): _TensorEntry,
    (_DCP, "ChunkStorageMetadata"): _Chunk,
    (_DCP, "TensorProperties"): _Properties,
    (_DCP, "MetadataIndex"): _Index,
    (_DCP, "BytesStorageMetadata"): Record,
    (_DCP, "StorageMeta"): Record,
    (_DCP, "_MEM_FORMAT_ENCODING"): int,  # an Enum pickles as cls(value)
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): str,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): PurePosixPath,  # StorageMeta.checkpoint_id as torch's FileSystemWriter sets it
    # megatron-core's save keeps the gathered save plans (`Metadata.all_local_plans`) to reuse them
    (_PLANNER, "SavePlan"): Record,
    (_PLANNER, "WriteItem"): Record,
    (_PLANNER, "WriteItemType"): int,
    (_PLANNER, "TensorWriteData"): Record,
    (_PLANNER, "BytesIOWriteData"): Record,
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
            raise pickle.UnpicklingError(f"unexpected object {module}.{name}")
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

    def __init__(self, directory: Path, reader: PositionedReader):
        self.dir, self._io = directory, reader
        try:
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
            # what MetadataIndex's hash and equality look at: the key and the chunk's offsets
            self._storage = {(i.fqn, tuple(i.offset or ())): info for i, info in self.md.storage_data.items()}
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

    def _item(self, key: str, chunk: _Chunk) -> _StorageInfo:
        info = self._storage.get((key, tuple(chunk.offsets)))
        if info is None:
            raise UserError(f"{self.dir}: no storage entry for the chunk of {key} at {tuple(chunk.offsets)} (damaged)")
        if info.transform_descriptors:
            raise UserError(f"{self.dir}: {key} is stored with transforms {info.transform_descriptors} (unsupported)")
        return info

    def _chunk(self, key: str, chunk: _Chunk) -> torch.Tensor:
        info = self._item(key, chunk)
        item = LazyTorchFile(self.dir / info.relative_path, self._io, info.offset, info.length)
        return item.read(item.obj)

    def _covering(self, loc: DistLocation):
        """(metadata, region lo, region hi, [(chunk, overlap lo, overlap hi)]) for `loc`."""
        tmd = self.md.state_dict_metadata.get(loc.key)
        if not isinstance(tmd, _TensorEntry):
            raise UserError(f"{self.dir}: the checkpoint has no tensor {loc.key}")
        n = len(loc.offsets)
        lo = loc.offsets + (0,) * (len(tmd.size) - n)
        hi = tuple(o + 1 for o in loc.offsets) + tuple(tmd.size[n:])
        hits = []
        for c in tmd.chunks:
            a = tuple(max(x, y) for x, y in zip(lo, c.offsets))
            b = tuple(min(x, o + s) for x, o, s in zip(hi, c.offsets, c.sizes))
            if all(x < y for x, y in zip(a, b)):
                hits.append((c, a, b))
        return tmd, lo, hi, hits

    def ranges(self, loc: DistLocation) -> list[tuple[Path, int, int]]:
        try:
            hits = self._covering(loc)[3]
        except UserError:
            return []
        infos = [self._storage.get((loc.key, tuple(c.offsets))) for c, _, _ in hits]
        return [(self.dir / i.relative_path, i.offset, i.length) for i in infos if i is not None]

    def single_chunk(self, loc: DistLocation) -> ChunkRegion | None:
        """The item holding exactly the region of `loc`, when one chunk is that region (always
        so in our own checkpoints), for moving its bytes; None when the region takes several
        chunks or a part of one (megatron's TP-split or stacked chunks): `read` assembles those."""
        tmd, lo, hi, hits = self._covering(loc)
        c = hits[0][0] if len(hits) == 1 else None
        if c is None or (tuple(c.offsets), tuple(o + s for o, s in zip(c.offsets, c.sizes))) != (lo, hi):
            return None
        info = self._item(loc.key, c)
        return ChunkRegion(
            self.dir / info.relative_path, info.offset, info.length, tuple(c.sizes), tmd.properties.dtype
        )

    def read(self, loc: DistLocation) -> torch.Tensor:
        import torch

        tmd, lo, hi, hits = self._covering(loc)
        inner = tuple(tmd.size[len(loc.offsets) :])
        out, filled = None, 0
        for c, a, b in hits:
            data = self._chunk(loc.key, c)
            c_lo = tuple(c.offsets)
            if (c_lo, tuple(o + s for o, s in zip(c.offsets, c.sizes))) == (lo, hi):
                return data.reshape(inner)
            if out is None:
                out = torch.empty(tuple(y - x for x, y in zip(lo, hi)), dtype=data.dtype)
            src = data[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, c_lo))]
            out[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))] = src
            filled += prod(y - x for x, y in zip(a, b))
        if out is None or filled != out.numel():
            raise UserError(f"{self.dir}: the chunks of {loc.key} do not cover position {loc.offsets} (incomplete)")
        return out.reshape(inner)


__all__ = ["DistLocation", "location", "extra_state_location", "DistWriter", "DistReader", "ChunkRegion", "DATA_FILE"]
