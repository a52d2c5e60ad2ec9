"""Streaming safetensors I/O without mmap: one tensor in memory at a time. The one reader of
HF weights: the converter's sources and the live loader (`bridge.loader.HFCheckpoint`,
through `LazySlice`) both read with it.

Why not `safe_open`: it mmaps whole files, and every page a conversion touches stays mapped
(and counted in the process RSS) until the handle closes, so converting a 5 GB shard costs
5 GB of RSS. Here each tensor is read with positioned reads (`os.preadv`) into a fresh
buffer; the kernel page cache, which is not the process's memory, does the caching.

Headers are validated before any byte is converted (JSON, dtypes, sizes matching shapes,
offsets inside the file), so a truncated or corrupt file, or an index naming a file or
tensor that is not there, is refused before anything is written.

The writer streams too: a file's tensor list (names, dtypes, shapes) is known up front, so
the header goes first and tensors are appended in that order as they are produced.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_bridge.convert.formats.dtypes import BY_ST as ST_DTYPES
from megatron_bridge.convert.formats.dtypes import DType, dtype_of
from megatron_bridge.convert.formats.paths import confined, require_regular
from megatron_bridge.convert.formats.readahead import will_need
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch and numpy are imported where used: the byte paths and `import bridge` never need them
    import numpy as np
    import torch

MAX_HEADER = 100 * 2**20  # safetensors' own limit
INDEX = "model.safetensors.index.json"
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)  # tensors that carry no weights (older checkpoints saved rotary buffers)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are: file and absolute [start, end) byte range."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    file: Path
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def raw_header(path: Path) -> tuple[dict, int]:
    """(the header's JSON object, `__metadata__` included, the data section's offset) of one
    file, its length checked against the file's. Raises UserError naming the file and the defect."""
    require_regular(path, "a safetensors file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise UserError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header length)")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER or 8 + n > size:
            raise UserError(
                f"{path}: header length {n} does not fit the {size}-byte file: truncated or not safetensors"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path}: corrupt safetensors header ({e})") from None
    return header, 8 + n


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate one file's header. Raises UserError naming the file and the defect."""
    header, base = raw_header(path)
    header.pop("__metadata__", None)
    size = path.stat().st_size
    data_len = size - base
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = ST_DTYPES[entry["dtype"]]
            shape = tuple(int(x) for x in entry["shape"])
            b, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise UserError(
                f"{path}: corrupt header entry for tensor {name!r} (unknown dtype or bad shape/offsets)"
            ) from None
        if end - b != prod(shape) * dtype.itemsize or b < 0:
            raise UserError(
                f"{path}: tensor {name} claims bytes [{b}, {end}) for shape {list(shape)} {entry['dtype']}: corrupt header"
            )
        if end > data_len:
            raise UserError(
                f"{path}: tensor {name} ends at byte {base + end} but the file has {size} bytes: "
                "the file is truncated (re-download or re-save it)"
            )
        out[name] = TensorInfo(name, dtype, shape, path, base + b, base + end)
    spans = sorted((t.start, t.end, t.name) for t in out.values() if t.end > t.start)
    for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
        if b1 < e0:  # the safetensors library refuses these too: one tensor's bytes would be another's
            raise UserError(
                f"{path}: tensors {n0} and {n1} claim overlapping bytes (data_offsets): corrupt or crafted header "
                "(re-download or re-save the file)"
            )
    return out


def scan_dir(path: Path) -> dict[str, TensorInfo]:
    """Every weight tensor of an HF model directory (sharded with an index, or plain files), in
    index / file order. Checks that files and tensors the index names exist."""
    if not path.is_dir():
        raise UserError(f"{path}: not a directory (expected an HF model directory with *.safetensors weights)")
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise TypeError("weight_map is not an object of tensor name -> file name")
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{index}: corrupt index ({e})") from None
        files = sorted(set(weight_map.values()))
        for f in files:  # names from the file: relative, inside the directory, regular files
            confined(path, f, source=index, what="shard")
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise UserError(f"{index} names {len(missing)} file(s) that do not exist: {', '.join(missing)}")
        headers = {f: read_header(path / f) for f in files}
        absent = [f"{k} ({f})" for k, f in weight_map.items() if k not in headers[f]]
        if absent:
            raise UserError(
                f"{index} places tensors in files that do not contain them: {', '.join(absent[:6])}"
                f"{' ...' if len(absent) > 6 else ''}"
            )
        infos = {k: headers[f][k] for k, f in weight_map.items()}
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            hint = f" (found {', '.join(other[:3])}: re-save with safe_serialization=True)" if other else ""
            raise UserError(f"{path}: no *.safetensors weights; only safetensors checkpoints are supported{hint}")
        infos = {}
        for f in files:
            confined(path, f, source=path, what="weight file", verb="holds")  # a FIFO, a link to elsewhere
            for k, info in read_header(path / f).items():
                if k in infos:
                    raise UserError(
                        f"{path}: tensor {k} is in both {infos[k].file.name} and {f} (and there is no index)"
                    )
                infos[k] = info
    return {k: v for k, v in infos.items() if not k.endswith(IGNORED_HF_SUFFIXES)}


class BufferPool:
    """Read buffers recycled instead of freed: a fresh buffer costs a page fault per page on
    first write (reading into a reused one is several times faster; docs/benchmarks.md), and
    a conversion reads every byte of a model.

    Buffers are numpy arrays handed out as `torch.from_numpy` views; the tensor (and every
    view of it) holds a reference to the array, so an array whose only references are the
    pool's is free for certain — no lifetime rules for callers. The pool never holds more
    than `cap` bytes (in use or free); reads it cannot serve are plain allocations."""

    MIN_BYTES = 2**20  # smaller reads are cheap to allocate

    def __init__(self, cap: int = 512 * 2**20):
        self.cap, self._lock = cap, threading.Lock()
        self._bufs: list[np.ndarray] = []

    def _free(self, i: int) -> bool:
        return sys.getrefcount(self._bufs[i]) == 2  # the pool's list and getrefcount's argument

    def take(self, nbytes: int) -> torch.Tensor:
        import numpy as np
        import torch

        if nbytes < self.MIN_BYTES or nbytes > self.cap:
            return torch.empty(nbytes, dtype=torch.uint8)
        with self._lock:
            free = [i for i in range(len(self._bufs)) if self._free(i)]
            fits = [i for i in free if nbytes <= self._bufs[i].nbytes <= 2 * nbytes]
            if fits:
                buf = self._bufs[min(fits, key=lambda i: self._bufs[i].nbytes)]
            else:
                total = sum(b.nbytes for b in self._bufs)
                dropped = set()
                for i in sorted(free, key=lambda i: -self._bufs[i].nbytes):  # make room: drop big free ones
                    if total + nbytes <= self.cap:
                        break
                    total -= self._bufs[i].nbytes
                    dropped.add(i)
                self._bufs = [b for i, b in enumerate(self._bufs) if i not in dropped]
                buf = np.empty(nbytes, dtype=np.uint8)
                if total + nbytes <= self.cap:
                    self._bufs.append(buf)
            return torch.from_numpy(buf[:nbytes])


class OpenFiles:
    """Read-only file descriptors by path, each opened once (`files(path)` -> fd)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def __call__(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def read_exactly(fd: int, view: memoryview, start: int, path: Path) -> None:
    """Fill `view` from byte `start` of `fd` (one read returns at most ~2 GiB on Linux); a
    file that ends first is reported as truncated."""
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], start + got)
        if k == 0:
            raise UserError(f"{path}: unexpected end of file at byte {start + got} (the file is truncated)")
        got += k


class PositionedReader:
    """Reads byte ranges of files into tensors (no mmap, file descriptors cached, buffers
    recycled through a `BufferPool`)."""

    def __init__(self) -> None:
        self._fd = OpenFiles()
        self.pool = BufferPool()

    def advise(self, path: Path, start: int, nbytes: int) -> None:
        """Tell the kernel this range is read next: it is fetched into the page cache in the
        background (no process memory), so the disk works while the current tensor converts.
        In read-ahead-window chunks (readahead.py): one call would fetch only the first few MiB."""
        will_need(self._fd(path), start, nbytes)

    def read_bytes(self, path: Path, start: int, nbytes: int) -> torch.Tensor:
        buf = self.pool.take(nbytes)
        if nbytes:
            read_exactly(self._fd(path), buf.numpy().data, start, path)
        return buf

    def read(self, info: TensorInfo) -> torch.Tensor:
        if info.nbytes == 0:
            import torch

            return torch.empty(info.shape, dtype=info.dtype.torch)
        return self.read_bytes(info.file, info.start, info.nbytes).view(info.dtype.torch).reshape(info.shape)

    def close(self) -> None:
        self._fd.close()


class LazySlice:
    """One tensor of a safetensors file, read when sliced: `.shape`, `.dtype` (torch's) and
    `[a:b]` / `[a:b, c:d]` that read only rows a..b, so a rank loading its shard reads just
    its part of the file. A column range reads its rows whole (one positioned read) and
    keeps a contiguous copy of the columns. What `bridge.shards.assemble` slices."""

    def __init__(self, info: TensorInfo, reader: PositionedReader):
        self.info, self._reader = info, reader
        self.shape = info.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.info.dtype.torch

    def __getitem__(self, idx: slice | tuple[slice, ...]) -> torch.Tensor:
        parts = idx if isinstance(idx, tuple) else (idx,)
        if not 1 <= len(parts) <= min(2, len(self.shape)) or any(
            not isinstance(p, slice) or p.step not in (None, 1) for p in parts
        ):
            raise TypeError(f"{self.info.name}: only [a:b] and [a:b, c:d] slices are read lazily, got {idx!r}")
        r0, r1, _ = parts[0].indices(self.shape[0])
        rows, row_bytes = max(r1 - r0, 0), prod(self.shape[1:]) * self.info.dtype.itemsize
        raw = self._reader.read_bytes(self.info.file, self.info.start + r0 * row_bytes, rows * row_bytes)
        t = raw.view(self.dtype).reshape((rows, *self.shape[1:]))
        return t[:, parts[1]].contiguous() if len(parts) == 2 else t

    def full(self) -> torch.Tensor:
        return self._reader.read(self.info)


def st_name(dtype) -> str:
    """safetensors' code ("BF16") of a DType or torch.dtype."""
    return dtype_of(dtype).st


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (any dtype, bf16 included), without a copy."""
    import torch

    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


class SafetensorsWriter:
    """One safetensors file whose tensor list is known up front; tensors are written in order."""

    def __init__(
        self, path: Path, entries: Sequence[tuple[str, DType, Sequence[int]]], metadata: dict[str, str] | None = None
    ):
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        pos = 0
        for name, dtype, shape in entries:
            n = prod(shape) * dtype.itemsize
            header[name] = {"dtype": st_name(dtype), "shape": list(shape), "data_offsets": [pos, pos + n]}
            pos += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
        self.path, self._entries, self._next = path, list(entries), 0
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self._entries[self._next]
        if (name, t.dtype, tuple(t.shape)) != (want[0], want[1], tuple(want[2])):
            raise RuntimeError(f"{self.path}: expected {want}, got {name} {t.dtype} {tuple(t.shape)}")
        self._f.write(tensor_bytes(t))
        self._next += 1

    def reserve(self, name: str) -> tuple[int, int]:
        """Skip the next tensor's bytes, to be written by the caller: returns (fd, offset)."""
        want = self._entries[self._next]
        if name != want[0]:
            raise RuntimeError(f"{self.path}: expected {want[0]}, got {name}")
        self._f.flush()
        at = self._f.tell()
        self._f.seek(prod(want[2]) * want[1].itemsize, os.SEEK_CUR)
        self._next += 1
        return self._f.fileno(), at

    def close(self) -> None:
        if self._next != len(self._entries):
            raise RuntimeError(f"{self.path}: {len(self._entries) - self._next} tensor(s) never written")
        self._f.close()


def plan_shards(entries: Iterable[tuple[str, DType, Sequence[int]]], max_bytes: int) -> list[list[tuple]]:
    """Split an ordered tensor list into files of at most `max_bytes` (a bigger tensor gets its own)."""
    files: list[list[tuple]] = [[]]
    size = 0
    for e in entries:
        n = prod(e[2]) * e[1].itemsize
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += n
    return files


__all__ = [
    "TensorInfo",
    "raw_header",
    "read_header",
    "scan_dir",
    "PositionedReader",
    "SafetensorsWriter",
    "plan_shards",
    "tensor_bytes",
    "BufferPool",
    "OpenFiles",
    "read_exactly",
    "LazySlice",
    "IGNORED_HF_SUFFIXES",
    "ST_DTYPES",
    "st_name",
    "INDEX",
]
