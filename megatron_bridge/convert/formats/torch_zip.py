"""`torch.save` files written and read one tensor at a time; torch is imported only to build tensors.

Megatron's classic checkpoints are one `torch.save` zip per rank (`model_optim_rng.pt`),
and each chunk of a torch_dist `.distcp` file is a `torch.save` archive too. `torch.save`
needs the whole object in memory, and `torch.load` either reads it all or mmaps it (touched
pages then count in the RSS until the file is closed). A rank file can hold a whole
pipeline stage, so both would break the converter's memory bound.

The zip format makes streaming easy: each tensor's bytes are a separate record
(`data/<key>`), and the pickle (`data.pkl`) only refers to records by key. The writer
stores each tensor's record as soon as it arrives (or reserves it, for a caller that fills
it with `os.copy_file_range`) and keeps a small stub; the pickle that ties the stubs into
the state dict is written last. The reader unpickles with stubs in place of storages (an
allowlist of globals, as `weights_only` loading has), finds the records with its own zip
reader (central directory, then each record's local header for its data offset) and reads
one record with one positioned read when asked. Files are ordinary `torch.save` files:
`torch.load(path, weights_only=True)` reads them (with `argparse.Namespace` allowlisted
when they carry Megatron's `args`).

Both are plain Python, but for the reader building tensors (importing torch costs about as
much as copying a mid-sized model, and `mbr convert` and `mbr export` are mostly byte moves;
docs/benchmarks.md). The writer writes what torch's own writer (`PyTorchFileWriter`,
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

import argparse
import collections
import fcntl
import hashlib
import io
import os
import pickle
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from megatron_bridge.convert.formats.dtypes import BY_NAME, DType, dtype_of
from megatron_bridge.convert.formats.pickling import Global, TorchPickler
from megatron_bridge.errors import UserError

if TYPE_CHECKING:
    import torch

    from megatron_bridge.convert.formats.safetensors_io import PositionedReader

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
_STORAGE_DTYPE = {storage: BY_NAME[name] for name, storage in _STORAGE_TYPE.items()}
_REBUILD_TENSOR = Global("torch._utils", "_rebuild_tensor_v2")

_U32 = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature .. extra field length: 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")


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

    def __init__(self, path: Path | BinaryIO):
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

    def fileno(self) -> int:
        return self._fd

    def _record(self, name: str, size: int, data: Any = None) -> int:
        """Write one record's local header (and `data`, if given) and data descriptor;
        returns the absolute file offset of its data. Mirrors miniz's
        mz_zip_writer_add_mem_ex_v2 with torch's alignment padding."""
        full = (self._prefix + name).encode("utf-8")
        ofs = self._pos
        big_size, big_ofs = size >= _U32, ofs >= _U32
        zip64 = big_size or big_ofs
        local64 = _zip64_extra((size, 0) if big_size else None, ofs if big_ofs else None) if zip64 else b""
        pad = -(ofs + _LOCAL.size + len(full) + len(local64) + 4) % ALIGN
        extra = local64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = 0x0808 if size else 0x0800  # UTF-8 name; a data descriptor follows non-empty data
        header = _LOCAL.pack(0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0, len(full), len(extra)) + full + extra
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
            _CENTRAL.pack(
                0x02014B50,
                0,
                0,
                flags,
                0,
                0,
                0,
                0,
                min(size, _U32),
                min(size, _U32),
                len(full),
                len(central64),
                0,
                0,
                0,
                0,
                min(ofs, _U32),
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
        end64 = _ZIP64_END.pack(0x06064B50, _ZIP64_END.size - 12, 0x031E, 0x002D, 0, 0, n, n, len(central), at)
        locator = _ZIP64_LOCATOR.pack(0x07064B50, 0, at + len(central), 1)
        end = _END.pack(0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF), min(len(central), _U32), min(at, _U32), 0)
        _pwrite_all(self._fd, [central, end64, locator, end], self._base + at)
        self._pos = at + len(central) + len(end64) + len(locator) + len(end)
        if self._own:
            self._file.close()
        else:
            self._file.seek(self._base + self._pos)


class _StubUnpickler(pickle.Unpickler):
    """Unpickles a torch.save pickle into TensorRefs; refuses any global outside the allowlist.
    dtypes come back as `DType`s."""

    SAFE = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("torch._utils", "_rebuild_tensor_v2"): lambda s, o, size, stride, *rest: TensorRef(
            s, o, tuple(size), tuple(stride)
        ),
    }

    def find_class(self, module, name):
        if (module, name) in self.SAFE:
            return self.SAFE[(module, name)]
        if module == "torch" and name in _STORAGE_DTYPE:
            return _STORAGE_DTYPE[name]
        if module == "torch" and name in BY_NAME:
            return BY_NAME[name]
        if module == "torch":  # a dtype outside DType's table (complex, quantized): torch's own
            import torch

            by_storage = {storage: d for d, storage in torch.storage._dtype_to_storage_type_map().items()}
            if name in by_storage:
                return by_storage[name]
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected object {module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        return StorageRef(str(key), dtype, int(numel))


def _pread(fd: int, n: int, at: int) -> bytes:
    """`n` bytes at `at`; a file that ends first is truncated (no zip field may point past it)."""
    got = os.pread(fd, n, at)
    if len(got) != n:
        raise ValueError(f"truncated: {n} bytes wanted at byte {at}, the file ends first")
    return got


def _zip64(extra: bytes, fields: list[int]) -> list[int]:
    """`fields` (size, size, local header offset) with each one that reads 0xFFFFFFFF
    replaced by the next value of the zip64 extended information field (tag 1)."""
    i = 0
    while i + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, i)
        if tag == 1:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, i + 4))
            if fields.count(_U32) > len(values):
                raise ValueError("zip64 extra field too short")
            return [values.pop(0) if v == _U32 else v for v in fields]
        i += 4 + n
    return fields


def _zip_records(fd: int, start: int, length: int) -> dict[str, tuple[int, int]]:
    """{name: (absolute data offset, size)} of the records of the zip at [start, start +
    length) of `fd`, names without the archive's folder: what `torch._C.PyTorchFileReader`
    lists (`get_all_records`, `get_record_offset`), without importing torch.

    Offsets inside the zip count from `start`, as torch writes a DCP item. A record's data
    follows its local header, whose extra field is not the central directory's (torch pads
    it to align the data), so each local header is read."""
    tail_len = min(length, _END.size + 0xFFFF)  # the end record and the longest comment it can have
    tail = _pread(fd, tail_len, start + length - tail_len)
    at = tail.rfind(b"PK\x05\x06", 0, tail_len - _END.size + 4)
    if at < 0:
        raise ValueError("no zip end-of-central-directory record: not a zip file, or truncated")
    end_at = length - tail_len + at
    _, _, _, _, n, size, ofs, _ = _END.unpack_from(tail, at)
    if end_at >= _ZIP64_LOCATOR.size:  # torch always writes the zip64 locator and end record
        locator = _pread(fd, _ZIP64_LOCATOR.size, start + end_at - _ZIP64_LOCATOR.size)
        sig, _, end64_at, _ = _ZIP64_LOCATOR.unpack(locator)
        if sig == 0x07064B50:
            end64 = _ZIP64_END.unpack(_pread(fd, _ZIP64_END.size, start + end64_at))
            if end64[0] != 0x06064B50:
                raise ValueError("corrupt zip64 end-of-central-directory record")
            n, size, ofs = end64[7:]
    if ofs + size > end_at:
        raise ValueError("the central directory runs past its end record: truncated or corrupt")
    central, pos, out, folder = _pread(fd, size, start + ofs), 0, {}, None
    for _ in range(n):
        (sig, _, _, _, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _, local) = (
            _CENTRAL.unpack_from(central, pos)
        )
        name_at, pos = pos + _CENTRAL.size, pos + _CENTRAL.size + name_len + extra_len + comment_len
        if sig != 0x02014B50 or pos > size:
            raise ValueError("corrupt zip central directory")
        name = central[name_at : name_at + name_len].decode("utf-8")
        usize, csize, local = _zip64(
            central[name_at + name_len : name_at + name_len + extra_len], [usize, csize, local]
        )
        if method != 0 or csize != usize:
            raise ValueError(f"record {name} is compressed (method {method}); torch.save stores records as they are")
        folder = folder or name[: name.find("/") + 1]
        if not folder or not name.startswith(folder):
            raise ValueError(f"record {name} is not in the archive's folder {folder or '(none)'}")
        head = _LOCAL.unpack(_pread(fd, _LOCAL.size, start + local))
        data = local + _LOCAL.size + head[-2] + head[-1]
        if head[0] != 0x04034B50 or data + usize > ofs:
            raise ValueError(f"record {name}: corrupt local header or data past the central directory")
        out[name[len(folder) :]] = (start + data, usize)
    return out


class LazyTorchFile:
    """Random access to the tensors of a torch.save zip (a whole file, or the byte range
    [start, start + length) of one), one positioned read per tensor. Only `read` imports
    torch: listing the records and unpickling the stubs is plain Python."""

    def __init__(self, path: Path, reader: PositionedReader, start: int = 0, length: int | None = None):
        self.path, self._io = path, reader
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                records = _zip_records(fd, start, os.fstat(fd).st_size - start if length is None else length)
                if "data.pkl" not in records:
                    raise ValueError("no data.pkl record")
                at, size = records["data.pkl"]
                self.obj = _StubUnpickler(io.BytesIO(_pread(fd, size, at))).load()
            finally:
                os.close(fd)
            self._offsets = {r[len("data/") :]: at for r, (at, _) in records.items() if r.startswith("data/")}
        except (struct.error, pickle.UnpicklingError, ValueError, EOFError, OSError) as e:
            where = f"{path}" if length is None else f"{path} bytes {start}..{start + length}"
            raise UserError(f"{where}: not a readable torch checkpoint ({str(e).splitlines()[0]})") from None

    def range(self, ref: TensorRef) -> tuple[Path, int, int]:
        """(file, start, length) of a tensor's record."""
        return self.path, self._offsets.get(ref.storage.key, 0), ref.storage.numel * ref.dtype.itemsize

    def read(self, ref: TensorRef) -> torch.Tensor:
        return self.read_box(ref, (0,) * len(ref.shape), ref.shape)

    def read_box(self, ref: TensorRef, lo: Sequence[int], hi: Sequence[int]) -> torch.Tensor:
        """The box [lo, hi) of tensor `ref` (the whole tensor: `read`), reading only the
        record's bytes from the box's first element to its last: a range of rows is one
        exact read, a range of columns reads its rows whole (as `LazySlice` does)."""
        import torch

        if ref.storage.key not in self._offsets:
            raise UserError(f"{self.path}: record data/{ref.storage.key} is missing (corrupt checkpoint)")
        dtype = ref.dtype.torch if isinstance(ref.dtype, DType) else ref.dtype
        shape = tuple(b - a for a, b in zip(lo, hi))
        if not all(0 <= a <= b <= n for a, b, n in zip(lo, hi, ref.shape)) or len(shape) != len(ref.shape):
            raise ValueError(f"box {list(lo)}..{list(hi)} is not inside a tensor of shape {list(ref.shape)}")
        if prod(shape) == 0:
            return torch.empty(shape, dtype=dtype)
        first = ref.offset + sum(a * s for a, s in zip(lo, ref.stride))
        last = ref.offset + sum((b - 1) * s for b, s in zip(hi, ref.stride))
        if last >= ref.storage.numel:
            raise UserError(f"{self.path}: record data/{ref.storage.key} is smaller than its tensor (corrupt)")
        size = ref.dtype.itemsize
        raw = self._io.read_bytes(self.path, self._offsets[ref.storage.key] + first * size, (last - first + 1) * size)
        t = raw.view(dtype).as_strided(shape, ref.stride, 0)
        return t if t.numel() == last - first + 1 else t.clone()


__all__ = ["StreamingTorchSave", "LazyTorchFile", "TensorRef", "StorageRef", "contiguous_stride", "ALIGN"]
