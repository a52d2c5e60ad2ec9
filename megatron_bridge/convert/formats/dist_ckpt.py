"""megatron-core `dist_checkpointing` ("torch_dist") checkpoints, written offline (read: `dist_read`).

The format is PyTorch Distributed Checkpoint (DCP) plus two megatron files:
`metadata.json` (which backends) and `common.pt` (the non-tensor state). In the DCP part,
`.metadata` is a pickled `torch.distributed.checkpoint.metadata.Metadata` (per key: global
shape, dtype, chunk list; per chunk: file, byte offset, length) and each chunk is one
`torch.save`d tensor inside a `.distcp` file. A chunk is addressed by a `DistLocation`: its
key and its position on the key's leading (layer[, expert]) axes. Which key and axes a
model's parameter has is the model's business (its backend's `Backend.dist_location`, the names
megatron's `GPTModel.sharded_state_dict()` gives); this module only writes what it is given.

megatron's own `dist_checkpointing.save` needs every tensor in memory at once and a process
group; writing the same files directly streams one chunk at a time. The data is global
(full tensors, world size 1), so megatron-core reshards it on load to any TP/PP/EP.

Neither side imports torch for the metadata: `.metadata` is written from `pickling`'s
stand-ins here and read back into `Record`s by `dist_read.DistReader`, so export can find a
chunk's bytes and move them without importing torch or `torch.distributed.checkpoint`
(docs/benchmarks.md).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_bridge.convert.formats.dtypes import DType, dtype_of
from megatron_bridge.convert.formats.pickling import Global, Instance, Reduce, TorchPickler, torch_size
from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave

DATA_FILE = "__0_0.distcp"  # the first data file; a bigger model gets __0_1.distcp, ... (data_files)
BYTES_PER_FILE = 2**30  # one data file per GiB of tensors ...
MAX_FILES = 8  # ... up to this many
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENTDCP_VERSION (a test holds them equal)
DCP = "torch.distributed.checkpoint.metadata"
PLANNER = "torch.distributed.checkpoint.planner"
_STRIDED = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))  # how torch pickles a layout
_CONTIGUOUS = Reduce(Global(DCP, "_MEM_FORMAT_ENCODING"), (0,))  # TensorProperties' memory_format
MEGATRON_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


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


def data_files(nbytes: int) -> int:
    """How many `.distcp` files hold `nbytes` of tensors: one per BYTES_PER_FILE, up to
    MAX_FILES. Several files let the byte path's workers copy in parallel — writes into one
    file contend for its inode (2-core box: two threads into two files 0.45-0.7 s, into one
    file 0.93-1.04 s, one thread 1.3-1.7 s for 1.67 GB; docs/benchmarks.md). A function of
    the size only, so the files are the same whatever `workers=` is; megatron-core's own
    saves write two per rank (its `thread_count`), and DCP's loader takes any number."""
    return max(1, min(MAX_FILES, -(-nbytes // BYTES_PER_FILE)))


class DistWriter:
    """Streams chunks into `.distcp` files (`data_files(nbytes)` of them, each chunk into the
    one holding the fewest bytes so far); `finish` writes the metadata that indexes them.
    A chunk's `StreamingTorchSave` carries its file's index as `lane`, so a byte path can
    keep each file's copies on one worker.

    No torch: each chunk is a `StreamingTorchSave` archive, and `.metadata` is the pickle of
    DCP's `Metadata` written from stand-ins (`pickling`) — the real classes live in
    `torch.distributed.checkpoint`, an import that costs more on top of torch's."""

    def __init__(self, directory: Path, nbytes: int = 0):
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.names = [DATA_FILE] + [f"__0_{k}.distcp" for k in range(1, data_files(nbytes))]
        self.paths = [directory / n for n in self.names]
        self._files = [open(p, "wb") for p in self.paths]
        # key -> (dtype, global size, [(chunk offsets, chunk sizes)]), or None for an object
        self._md: dict[str, tuple[DType, tuple[int, ...], list[tuple[tuple[int, ...], ...]]] | None] = {}
        # (key, chunk offsets, chunk index, file index, start, length)
        self._storage: list[tuple[str, tuple[int, ...] | None, int | None, int, int, int]] = []

    def _write(
        self, key: str, offsets: tuple[int, ...] | None, index: int | None, fill: Callable[[StreamingTorchSave], Any]
    ) -> None:
        k = min(range(len(self._files)), key=lambda i: self._files[i].tell())
        f = self._files[k]
        start = f.tell()
        item = StreamingTorchSave(f, lane=k)
        item.finish(fill(item))
        self._storage.append((key, offsets, index, k, start, f.tell() - start))

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
            return Instance(DCP, "ChunkStorageMetadata", {"offsets": torch_size(offsets), "sizes": torch_size(sizes)})

        entries: dict[str, Instance] = {}
        for key, md in self._md.items():
            if md is None:
                entries[key] = Instance(DCP, "BytesStorageMetadata", {})
                continue
            dtype, size, chunks = md
            props = Instance(DCP, "TensorProperties", (dtype, _STRIDED, False, _CONTIGUOUS, False))
            entries[key] = Instance(
                DCP,
                "TensorStorageMetadata",
                {"properties": props, "size": torch_size(size), "chunks": [chunk(o, s) for o, s in chunks]},
            )
        storage = {}
        for key, offsets, index, k, start, length in self._storage:
            where = Instance(
                DCP,
                "MetadataIndex",
                {"fqn": key, "offset": None if offsets is None else torch_size(offsets), "index": index},
            )
            storage[where] = Instance(
                "torch.distributed.checkpoint.filesystem",
                "_StorageInfo",
                {"relative_path": self.names[k], "offset": start, "length": length},
            )
        meta = Instance(
            DCP, "StorageMeta", {"checkpoint_id": None, "save_id": str(uuid.uuid4()), "load_id": None, "modules": []}
        )
        return Instance(
            DCP,
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
        for f in self._files:
            f.close()
        with open(self.dir / ".metadata", "wb") as f:
            TorchPickler(f).dump(self._metadata())
        StreamingTorchSave(self.dir / "common.pt").finish(common)
        (self.dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))


__all__ = ["DistLocation", "DistWriter", "DATA_FILE", "MEGATRON_METADATA", "data_files"]
