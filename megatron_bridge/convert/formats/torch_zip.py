"""`torch.save` files written one tensor at a time, without torch (read back: `torch_zip_read`).

Megatron's classic checkpoints are one `torch.save` zip per rank (`model_optim_rng.pt`),
and each chunk of a torch_dist `.distcp` file is a `torch.save` archive too. `torch.save`
needs the whole object in memory, and `torch.load` either reads it all or mmaps it (touched
pages then count in the RSS until the file is closed). A rank file can hold a whole
pipeline stage, so both would break the converter's memory bound.

The zip format makes streaming easy: each tensor's bytes are a separate record
(`data/<key>`), and the pickle (`data.pkl`) only refers to records by key. The writer
stores each tensor's record as soon as it arrives (or reserves it, for a caller that fills
it with `os.copy_file_range`) and keeps a small stub; the pickle that ties the stubs into
the state dict is written last (the reader, `torch_zip_read`, goes the other way). Files
are ordinary `torch.save` files: `torch.load(path, weights_only=True)` reads them (with
`argparse.Namespace` allowlisted when they carry Megatron's `args`).

Plain Python: importing torch costs about as much as copying a mid-sized model, and `mbr
convert` and `mbr export` are mostly byte moves. Against `torch.save` of the whole state
dict (benchmarks/formats_vs_library.py, docs/benchmarks.md, ~1 GB model): on the byte path
0.2× the process time and 0.02× the peak RSS (no torch, no tensors); with tensors in hand
about the same time and 0.35× the RSS (one tensor at a time). The writer writes what torch's own writer (`PyTorchFileWriter`,
miniz, CRC-32 off) writes, byte for byte but for the serialization id, so every reader of
torch files reads them:

- records `<archive>/data/<key>` in `add` order, then `data.pkl`, `.format_version` ("1"),
  `.storage_alignment` ("64"), `byteorder`, `version` ("3\\n"), `.data/serialization_id`;
  `<archive>` is the file name up to its last dot, or "archive" for an open file;
- all STORED, DOS time 0, flags 0x808 (UTF-8 names, data descriptor) or 0x800 when empty;
  CRC-32 fields 0 (torch's compute_crc32=False; torch.load does not check them, and
  mbr_manifest.json carries checksums of every tensor instead; Python's `zipfile` refuses
  such members, as it refuses torch's);
- each record's data starts 64-byte aligned (relative to the archive's start): the local
  header's extra field "FB" is padding of 'Z's;
- zip64 as miniz writes it: a zip64 extra field (local and central) for a record of
  >= 0xFFFFFFFF bytes or at an offset >= 0xFFFFFFFF, with a 64-bit data descriptor, and
  always the zip64 end-of-central-directory record and locator.
"""

from __future__ import annotations

import collections
import fcntl
import hashlib
import io
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from megatron_bridge.convert.formats.dtypes import BY_NAME, DType, dtype_of
from megatron_bridge.convert.formats.pickling import Global, TorchPickler

if TYPE_CHECKING:
    import torch


ALIGN = 64  # what torch.save writes (`.storage_alignment`); mmap-loading needs it
_STORAGE_TYPE = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
}
STORAGE_DTYPE = {storage: BY_NAME[name] for name, storage in _STORAGE_TYPE.items()}
_REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")

# zip records (shared with the reader, torch_zip_read)
ZIP_U32 = 0xFFFFFFFF
ZIP_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature .. extra field length: 30 bytes
ZIP_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
ZIP64_END = struct.Struct("<IQHHIIQQQQ")
ZIP64_LOCATOR = struct.Struct("<IIQI")
ZIP_END = struct.Struct("<IHHHHIIH")


@dataclass(frozen=True)
class StorageRef:
    key: str
    dtype: DType
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a rank file: its record, dtype and view geometry."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> DType:
        return self.storage.dtype


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of `shape`, as torch computes them (0-sized dims count as 1)."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class _Pickler(TorchPickler):
    """Pickles `TensorRef`s exactly as `torch.save` pickles CPU tensors."""

    dispatch = TorchPickler.dispatch.copy()

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is StorageRef:
            return ("storage", Global("torch", _STORAGE_TYPE[obj.dtype.name]), obj.key, "cpu", obj.numel)
        return None

    def save_tensor(self, t: TensorRef) -> None:
        hooks: collections.OrderedDict[str, Any] = collections.OrderedDict()  # backward hooks: none
        args = (t.storage, t.offset, tuple(t.shape), tuple(t.stride), False, hooks)
        self.save_call(_REBUILD_TENSOR, args, t)

    dispatch[TensorRef] = save_tensor  # type: ignore[assignment]  # typeshed: takes an Unpickler (see pickling.py)


def _pwrite_all(fd: int, bufs: list[Any], offset: int) -> None:
    """`os.pwritev` until every byte is out (one call writes at most ~2 GiB on Linux)."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views:
            views[0] = views[0][n:]


def _zip64_extra(size: tuple[int, int] | None, offset: int | None) -> bytes:
    """miniz's zip64 extended information field: (uncompressed, compressed) size, offset."""
    body = struct.pack("<QQ", *size) if size is not None else b""
    body += struct.pack("<Q", offset) if offset is not None else b""
    return struct.pack("<HH", 1, len(body)) + body


class StreamingTorchSave:
    """Write a `torch.save`-compatible file tensor by tensor; `finish(obj)` pickles `obj`, a
    nested structure holding the `TensorRef`s that `add` / `reserve` returned.

    Given an open file, the archive is appended at its position (a DCP item): offsets
    inside the zip count from there, as torch's writer does for a stream, and the file's
    position is left at the archive's end by `finish`."""

    def __init__(self, path: Path | BinaryIO, lane: int | None = None):
        if isinstance(path, (str, os.PathLike)):
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file: BinaryIO = open(path, "wb", buffering=0)
            self.path, self._own = path, True
            stem = path.name[: path.name.rfind(".")] if "." in path.name else path.name
            self._prefix = (stem or "archive") + "/"  # torch's basename()
        else:
            path.flush()
            self.path, self._file, self._own = Path(path.name), path, False
            self._prefix = "archive/"
        self._fd = self._file.fileno()
        if fcntl.fcntl(self._fd, fcntl.F_GETFL) & os.O_APPEND:
            raise ValueError(f"{self.path}: opened for appending; positioned writes would land at its end")
        self._base = self._file.tell()  # the archive's start in the OS file
        self._pos = 0  # the next record's offset in the archive
        self._central: list[bytes] = []
        self._names: list[str] = []
        self._n = 0
        self.lane = lane  # which of its writer's files this is (dist_ckpt.DistWriter), for the byte path's pool

    def fileno(self) -> int:
        return self._fd

    def _record(self, name: str, size: int, data: Any = None) -> int:
        """Write one record's local header (and `data`, if given) and data descriptor;
        returns the absolute file offset of its data. Mirrors miniz's
        mz_zip_writer_add_mem_ex_v2 with torch's alignment padding."""
        full = (self._prefix + name).encode("utf-8")
        ofs = self._pos
        big_size, big_ofs = size >= ZIP_U32, ofs >= ZIP_U32
        zip64 = big_size or big_ofs
        local64 = _zip64_extra((size, 0) if big_size else None, ofs if big_ofs else None) if zip64 else b""
        pad = -(ofs + ZIP_LOCAL.size + len(full) + len(local64) + 4) % ALIGN
        extra = local64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = 0x0808 if size else 0x0800  # UTF-8 name; a data descriptor follows non-empty data
        header = ZIP_LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra
        descriptor = b""
        if size:
            descriptor = struct.pack("<II", 0x08074B50, 0) + struct.pack("<QQ" if zip64 else "<II", size, size)
        start = self._base + ofs + len(header)
        if data is None:  # reserved: the caller fills [start, start + size)
            _pwrite_all(self._fd, [header], self._base + ofs)
            _pwrite_all(self._fd, [descriptor], start + size)
        else:
            _pwrite_all(self._fd, [header, data, descriptor], self._base + ofs)
        central64 = _zip64_extra((size, size) if big_size else None, ofs if big_ofs else None) if zip64 else b""
        self._central.append(
            ZIP_CENTRAL.pack(
                0x02014B50,
                0,
                0,
                flags,
                0,
                0,
                0,
                0,
                min(size, ZIP_U32),
                min(size, ZIP_U32),
                len(full),
                len(central64),
                0,
                0,
                0,
                0,
                min(ofs, ZIP_U32),
            )
            + full
            + central64
        )
        self._names.append(name)
        self._pos = ofs + len(header) + size + len(descriptor)
        return start

    def _ref(self, dtype: Any, shape: Sequence[int]) -> TensorRef:
        key = str(self._n)
        self._n += 1
        shape = tuple(int(n) for n in shape)
        return TensorRef(StorageRef(key, dtype_of(dtype), prod(shape)), 0, shape, contiguous_stride(shape))

    def add(self, t: torch.Tensor) -> TensorRef:
        """Store `t`'s values (only its own bytes, even for a view of a bigger tensor)."""
        import torch

        t = t.detach().contiguous()
        ref = self._ref(t.dtype, t.shape)
        data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        self._record(f"data/{ref.storage.key}", t.nbytes, data)
        return ref

    def reserve(self, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> tuple[TensorRef, int]:
        """Make room for a contiguous tensor that the caller writes itself: returns its
        `TensorRef` and the absolute offset in `fileno()` where exactly `nbytes` bytes go
        (`os.pwrite`, `os.copy_file_range`). Until then the record reads as zeros."""
        if nbytes != prod(shape) * dtype_of(dtype).itemsize:
            raise ValueError(f"{nbytes} bytes do not hold a {dtype} tensor of shape {list(shape)}")
        ref = self._ref(dtype, shape)
        return ref, self._record(f"data/{ref.storage.key}", nbytes)

    def finish(self, obj: Any) -> None:
        buf = io.BytesIO()
        _Pickler(buf).dump(obj)
        pkl = buf.getvalue()
        self._record("data.pkl", len(pkl), pkl)
        for name, value in (
            (".format_version", b"1"),
            (".storage_alignment", str(ALIGN).encode()),
            ("byteorder", sys.byteorder.encode()),
            ("version", b"3\n"),
        ):
            self._record(name, len(value), value)
        # torch hashes the record names and CRCs; without CRCs, the names and the pickle
        # (which lists every record's size and dtype) give an id as deterministic as torch's
        h = hashlib.blake2b("\n".join(self._names).encode() + pkl, digest_size=16)
        self._record(".data/serialization_id", 40, f"{int.from_bytes(h.digest(), 'big'):040d}".encode())
        central = b"".join(self._central)
        at, n = self._pos, len(self._central)
        end64 = ZIP64_END.pack(0x06064B50, ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0, n, n, len(central), at)
        locator = ZIP64_LOCATOR.pack(0x07064B50, 0, at + len(central), 1)
        end = ZIP_END.pack(
            0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(central), ZIP_U32), min(at, ZIP_U32), 0
        )
        _pwrite_all(self._fd, [central, end64, locator, end], self._base + at)
        self._pos = at + len(central) + len(end64) + len(locator) + len(end)
        if self._own:
            self._file.close()
        else:
            self._file.seek(self._base + self._pos)


__all__ = ["StreamingTorchSave", "TensorRef", "StorageRef", "contiguous_stride", "ALIGN"]
