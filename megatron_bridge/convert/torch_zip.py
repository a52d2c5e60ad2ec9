"""`torch.save` files written and read one tensor at a time.

Megatron's classic checkpoints are one `torch.save` zip per rank (`model_optim_rng.pt`).
`torch.save` needs the whole object in memory, and `torch.load` either reads it all or
mmaps it (touched pages then count in the RSS until the file is closed). A rank file can
hold a whole pipeline stage, so both would break the converter's memory bound.

The zip format makes streaming easy: each tensor's bytes are a separate record
(`data/<key>`), and the pickle (`data.pkl`) only refers to records by key. The writer
stores each tensor's record as soon as it arrives and keeps a small stub; the pickle that
ties the stubs into the state dict is written last. The reader unpickles with stubs in
place of storages (an allowlist of globals, as `weights_only` loading has) and reads one
record with one positioned read when asked. Files are ordinary `torch.save` files:
`torch.load(path, weights_only=True)` reads them (with `argparse.Namespace` allowlisted
when they carry Megatron's `args`).
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, Tuple, Union

import torch

from megatron_bridge.convert.safetensors_io import PositionedReader
from megatron_bridge.errors import UserError

_STORAGE_DTYPE = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a rank file: its record, dtype and view geometry."""

    storage: StorageRef
    offset: int
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    def __reduce_ex__(self, protocol):  # pickles exactly as torch pickles a CPU tensor
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, self.offset, self.shape, self.stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, StorageRef):
            storage_type = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", storage_type, obj.key, "cpu", obj.numel)
        return None


class StreamingTorchSave:
    """Write a `torch.save`-compatible file tensor by tensor; `finish(obj)` pickles `obj`, a
    nested structure holding the `TensorRef`s that `add` returned.

    crc32=False: the zip's per-record CRC costs ~0.4 GB/s of one core (miniz), more than the
    rest of a conversion; torch.load does not check it, and mbr_manifest.json carries
    end-to-end checksums of every tensor instead."""

    def __init__(self, path: Union[Path, BinaryIO], crc32: bool = False):
        if isinstance(path, Path):
            path.parent.mkdir(parents=True, exist_ok=True)
            self.path = path
            self._w = torch._C.PyTorchFileWriter(str(path), crc32, 64)
        else:  # an open file: the archive is appended at its position (a DCP item)
            self.path = Path(path.name)
            self._w = torch._C.PyTorchFileWriter(path, crc32, 64)
        self._n = 0

    def add(self, t: torch.Tensor) -> TensorRef:
        t = t.detach().contiguous()
        if t.untyped_storage().nbytes() != t.nbytes:  # a view of a bigger tensor: store only its bytes
            t = t.clone()
        key = str(self._n)
        self._n += 1
        self._w.write_record(f"data/{key}", t.untyped_storage(), t.nbytes)
        stride = tuple(t.stride()) if t.dim() else ()
        return TensorRef(StorageRef(key, t.dtype, t.numel()), 0, tuple(t.shape), stride)

    def finish(self, obj: Any) -> None:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        data = buf.getvalue()
        self._w.write_record("data.pkl", data, len(data))
        self._w.write_record(".format_version", "1", 1)
        self._w.write_record(".storage_alignment", "64", 2)
        self._w.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._w.write_end_of_file()
        del self._w


class _StubUnpickler(pickle.Unpickler):
    """Unpickles a torch.save pickle into TensorRefs; refuses any global outside the allowlist."""

    SAFE = {("collections", "OrderedDict"): collections.OrderedDict, ("argparse", "Namespace"): argparse.Namespace,
            ("torch._utils", "_rebuild_tensor_v2"): lambda s, o, size, stride, *rest: TensorRef(s, o, tuple(size), tuple(stride))}

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return self.SAFE[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPE:
            return _STORAGE_DTYPE[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        return StorageRef(str(key), dtype, int(numel))


class _Region(io.RawIOBase):
    """A byte range of a file as a seekable stream (a torch.save item inside a DCP file)."""

    def __init__(self, path: Path, start: int, length: int):
        super().__init__()
        self._f, self._start, self._len, self._pos = open(path, "rb"), start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, off: int, whence: int = 0) -> int:
        self._pos = off if whence == 0 else self._pos + off if whence == 1 else self._len + off
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n]) or 0
        self._pos += got
        return got

    def close(self) -> None:
        self._f.close()
        super().close()


class LazyTorchFile:
    """Random access to the tensors of a torch.save zip (a whole file, or the byte range
    [start, start + length) of one), one positioned read per tensor."""

    def __init__(self, path: Path, reader: PositionedReader, start: int = 0, length: Optional[int] = None):
        self.path, self._io = path, reader
        region = _Region(path, start, length) if length is not None else None
        try:
            zf = torch._C.PyTorchFileReader(region if region is not None else str(path))
            self.obj = _StubUnpickler(io.BytesIO(zf.get_record("data.pkl"))).load()
            self._offsets = {r[len("data/"):]: start + zf.get_record_offset(r)
                             for r in zf.get_all_records() if r.startswith("data/")}
            del zf
            if region is not None:
                region.close()
        except (RuntimeError, pickle.UnpicklingError, ValueError, EOFError, OSError) as e:
            where = f"{path}" if length is None else f"{path} bytes {start}..{start + length}"
            raise UserError(f"{where}: not a readable torch checkpoint ({str(e).splitlines()[0]})") from None

    def range(self, ref: TensorRef) -> Tuple[Path, int, int]:
        """(file, start, length) of a tensor's record."""
        return self.path, self._offsets.get(ref.storage.key, 0), ref.storage.numel * ref.dtype.itemsize

    def read(self, ref: TensorRef) -> torch.Tensor:
        if ref.storage.key not in self._offsets:
            raise UserError(f"{self.path}: record data/{ref.storage.key} is missing (corrupt checkpoint)")
        nbytes = ref.storage.numel * ref.dtype.itemsize
        raw = self._io.read_bytes(self.path, self._offsets[ref.storage.key], nbytes).view(ref.dtype)
        t = raw.as_strided(ref.shape, ref.stride, ref.offset)
        return t if t.numel() == raw.numel() else t.clone()


__all__ = ["StreamingTorchSave", "LazyTorchFile", "TensorRef", "StorageRef"]
