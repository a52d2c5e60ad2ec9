"""`torch.save` files read back one tensor at a time, without torch (the format: `torch_zip`).

The reader unpickles `data.pkl` with stubs in place of storages (an allowlist of globals,
as `weights_only` loading has), finds the records with its own zip reader (central
directory, then each record's local header for its data offset) and reads one record, or
the span of one box of it, with one positioned read when asked. Only the methods that build
tensors import torch: listing the records and unpickling the stubs is plain Python.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import struct
import types
from collections.abc import Mapping, Sequence
from math import prod
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from megatron_bridge.convert.formats.dtypes import BY_NAME, DType
from megatron_bridge.convert.formats.pickle_guard import (
    MEGATRON_RECORDS,
    NUMPY,
    Name,
    Refused,
    ScanUnpickler,
    python3_name,
    refusal,
)
from megatron_bridge.convert.formats.torch_zip import (
    STORAGE_DTYPE,
    ZIP64_END,
    ZIP64_LOCATOR,
    ZIP_CENTRAL,
    ZIP_END,
    ZIP_LOCAL,
    ZIP_U32,
    StorageRef,
    TensorRef,
)
from megatron_bridge.errors import UserError

if TYPE_CHECKING:
    import torch

    from megatron_bridge.convert.formats.safetensors_io import PositionedReader


class Opaque:
    """An allowed object that is kept by name and never built: an enum value, a `BytesIO`, a
    NumPy array of an RNG state, a record class of megatron-core's (`what`: its module.name;
    `args` and `state`: what the pickle gave it). Made per name by `opaque`."""

    what = ""
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any) -> Opaque:
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{self.what}{self.args!r}>"


def opaque(module: str, name: str) -> type[Opaque]:
    return type(name, (Opaque,), {"what": f"{module}.{name}"})


def _posix_path(*parts: str) -> str:
    return str(PurePosixPath(*parts))


def _latin1(text: str, encoding: str = "latin1") -> bytes:
    """`_codecs.encode` as protocol-2 pickles call it for a `bytes` value, and only so."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode called with {encoding!r}: not a bytes value")
    return text.encode("latin1")


# What a Megatron-LM / NeMo / Megatron-Bridge file's names load as (`pickle_guard.MEGATRON`):
# namespaces as themselves (their `args`), paths as strings, everything else opaque.
MEGATRON_STANDINS: dict[Name, Any] = {
    **{n: opaque(*n) for n in MEGATRON_RECORDS | NUMPY},
    ("argparse", "Namespace"): argparse.Namespace,
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    ("pathlib", "PosixPath"): _posix_path,
    ("_codecs", "encode"): _latin1,
}


class _StubUnpickler(pickle.Unpickler):
    """Unpickles a torch.save pickle into TensorRefs; refuses any global outside the allowlist
    (`pickle_guard.Refused`, before it is called). dtypes come back as `DType`s; `extra`:
    further allowed names and what each loads as (`MEGATRON_STANDINS`)."""

    def __init__(self, file: Any, extra: Mapping[Name, Any] | None = None):
        super().__init__(file)
        self._extra = extra or {}

    SAFE = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("argparse", "Namespace"): argparse.Namespace,
        ("torch._utils", "_rebuild_tensor_v2"): lambda s, o, size, stride, *rest: TensorRef(
            s, o, tuple(size), tuple(stride)
        ),
    }

    def find_class(self, module, name):
        module, name = python3_name(module, name)
        if (module, name) in self.SAFE:
            return self.SAFE[(module, name)]
        if (module, name) in self._extra:
            return self._extra[(module, name)]
        if module == "torch" and name in STORAGE_DTYPE:
            return STORAGE_DTYPE[name]
        if module == "torch" and name in BY_NAME:
            return BY_NAME[name]
        if module == "torch":  # a dtype outside DType's table (complex, quantized): torch's own
            import torch

            by_storage = {storage: d for d, storage in torch.storage._dtype_to_storage_type_map().items()}
            if name in by_storage:
                return by_storage[name]
            if isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
        raise Refused(module, name)

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
            if fields.count(ZIP_U32) > len(values):
                raise ValueError("zip64 extra field too short")
            return [values.pop(0) if v == ZIP_U32 else v for v in fields]
        i += 4 + n
    return fields


def _zip_records(fd: int, start: int, length: int) -> dict[str, tuple[int, int]]:
    """{name: (absolute data offset, size)} of the records of the zip at [start, start +
    length) of `fd`, names without the archive's folder: what `torch._C.PyTorchFileReader`
    lists (`get_all_records`, `get_record_offset`), without importing torch.

    Offsets inside the zip count from `start`, as torch writes a DCP item. A record's data
    follows its local header, whose extra field is not the central directory's (torch pads
    it to align the data), so each local header is read."""
    tail_len = min(length, ZIP_END.size + 0xFFFF)  # the end record and the longest comment it can have
    tail = _pread(fd, tail_len, start + length - tail_len)
    at = tail.rfind(b"PK\x05\x06", 0, tail_len - ZIP_END.size + 4)
    if at < 0:
        raise ValueError("no zip end-of-central-directory record: not a zip file, or truncated")
    end_at = length - tail_len + at
    _, _, _, _, n, size, ofs, _ = ZIP_END.unpack_from(tail, at)
    if end_at >= ZIP64_LOCATOR.size:  # torch always writes the zip64 locator and end record
        locator = _pread(fd, ZIP64_LOCATOR.size, start + end_at - ZIP64_LOCATOR.size)
        sig, _, end64_at, _ = ZIP64_LOCATOR.unpack(locator)
        if sig == 0x07064B50:
            end64 = ZIP64_END.unpack(_pread(fd, ZIP64_END.size, start + end64_at))
            if end64[0] != 0x06064B50:
                raise ValueError("corrupt zip64 end-of-central-directory record")
            n, size, ofs = end64[7:]
    if ofs + size > end_at:
        raise ValueError("the central directory runs past its end record: truncated or corrupt")
    central, pos, out, folder = _pread(fd, size, start + ofs), 0, {}, None
    for _ in range(n):
        (sig, _, _, _, method, _, _, _, csize, usize, name_len, extra_len, comment_len, _, _, _, local) = (
            ZIP_CENTRAL.unpack_from(central, pos)
        )
        name_at, pos = pos + ZIP_CENTRAL.size, pos + ZIP_CENTRAL.size + name_len + extra_len + comment_len
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
        head = ZIP_LOCAL.unpack(_pread(fd, ZIP_LOCAL.size, start + local))
        data = local + ZIP_LOCAL.size + head[-2] + head[-1]
        if head[0] != 0x04034B50 or data + usize > ofs:
            raise ValueError(f"record {name}: corrupt local header or data past the central directory")
        out[name[len(folder) :]] = (start + data, usize)
    return out


def _where(path: Path, start: int, length: int | None) -> str:
    return f"{path}" if length is None else f"{path} bytes {start}..{start + length}"


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of a pre-zip `torch.save` file


def scan_torch_file(path: Path, allowed: frozenset[Name], *, strict: bool = True) -> None:
    """Check that a `torch.save` file names only `allowed` globals, building nothing and
    running nothing (`pickle_guard.ScanUnpickler`): a zip's `data.pkl`, or the pickles of the
    legacy format (magic number, protocol, system info, the object, its storage keys).
    UserError naming the file: `pickle_guard.refusal`, or (`strict`) not a torch file at all;
    `strict=False` leaves a file it cannot parse to the load, which is weights-only too."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if _pread(fd, 4, 0) == b"PK\x03\x04":
                records = _zip_records(fd, 0, size)
                if "data.pkl" not in records:
                    raise ValueError("no data.pkl record")
                at, n = records["data.pkl"]
                ScanUnpickler(io.BytesIO(_pread(fd, n, at)), allowed).load()
                return
            with os.fdopen(os.dup(fd), "rb") as f:
                if ScanUnpickler(f, allowed).load() != _LEGACY_MAGIC:
                    raise ValueError("neither a zip archive nor a legacy torch.save file")
                for _ in range(4):  # protocol, system info, the object, the storage keys
                    ScanUnpickler(f, allowed).load()
        finally:
            os.close(fd)
    except Refused as e:
        raise refusal(path, e.what) from None
    except (struct.error, pickle.UnpicklingError, ValueError, EOFError, OSError, TypeError, AttributeError) as e:
        if strict:
            raise UserError(f"{path}: not a readable torch checkpoint ({str(e).splitlines()[0]})") from None


class LazyTorchFile:
    """Random access to the tensors of a torch.save zip (a whole file, or the byte range
    [start, start + length) of one), one positioned read per tensor. Only `read` imports
    torch: listing the records and unpickling the stubs is plain Python."""

    def __init__(
        self,
        path: Path,
        reader: PositionedReader,
        start: int = 0,
        length: int | None = None,
        extra: Mapping[Name, Any] | None = None,
    ):
        """`extra`: names allowed besides tensors and `argparse.Namespace`, and their
        stand-ins (`MEGATRON_STANDINS` for a checkpoint Megatron-LM wrote)."""
        self.path, self._io = path, reader
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                records = _zip_records(fd, start, os.fstat(fd).st_size - start if length is None else length)
                if "data.pkl" not in records:
                    raise ValueError("no data.pkl record")
                at, size = records["data.pkl"]
                self.obj = _StubUnpickler(io.BytesIO(_pread(fd, size, at)), extra).load()
            finally:
                os.close(fd)
            self._offsets = {r[len("data/") :]: at for r, (at, _) in records.items() if r.startswith("data/")}
        except Refused as e:
            raise refusal(_where(path, start, length), e.what) from None
        except (struct.error, pickle.UnpicklingError, ValueError, EOFError, OSError) as e:
            raise UserError(
                f"{_where(path, start, length)}: not a readable torch checkpoint ({str(e).splitlines()[0]})"
            ) from None

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


__all__ = ["LazyTorchFile", "MEGATRON_STANDINS", "Opaque", "scan_torch_file"]
