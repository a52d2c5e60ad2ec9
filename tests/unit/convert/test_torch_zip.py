"""The torch-free `torch.save` writer (`StreamingTorchSave`) and pickler (`pickling`).

The writer claims to write what torch's own zip writer writes, byte for byte but for the
serialization id, so the strongest check is a replay: every record of our file is written
again, in the same order, with `torch._C.PyTorchFileWriter` (crc32 off, alignment 64, what
torch.save uses) and the two files are compared. The same is done for an archive appended
to an open file (a DCP item) and for a sparse >4 GiB file that needs zip64. On top of that,
torch.load and `LazyTorchFile` must read back what went in, and `data.pkl` must be the
bytes torch.save pickles for the same object made of real tensors. `LazyTorchFile`'s own zip
reader must list what torch's reader lists (records, data offsets, the unpickled stubs) for
files of torch.save and of the writer, whole or as a region of a bigger file.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from megatron_bridge.convert.formats.dtypes import BFLOAT16, BY_NAME, FLOAT32
from megatron_bridge.convert.formats.pickling import Global, Instance, Reduce, TorchPickler, torch_size
from megatron_bridge.convert.formats.safetensors_io import PositionedReader
from megatron_bridge.convert.formats.torch_zip import (
    _STORAGE_TYPE,
    ALIGN,
    StorageRef,
    StreamingTorchSave,
    TensorRef,
    contiguous_stride,
)
from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile, _StubUnpickler, _zip_records
from megatron_bridge.errors import UserError

Record = tuple[str, int, int]  # name inside the archive, data offset in the file, size


def records(path: Path, start: int = 0, length: int = 0) -> list[Record]:
    """The archive's records in file order (zipfile lists them; it cannot read them: CRCs are 0)."""
    out = []
    with open(path, "rb") as f:
        f.seek(start)
        region = io.BytesIO(f.read(length)) if length else None
        zf = zipfile.ZipFile(region or f)
        for info in zf.infolist():
            (region or f).seek(info.header_offset)
            head = (region or f).read(30)
            assert head[:4] == b"PK\x03\x04"
            name_len, extra_len = struct.unpack("<HH", head[26:30])
            out.append((info.filename, start + info.header_offset + 30 + name_len + extra_len, info.file_size))
    return sorted(out, key=lambda r: r[1])


def read_at(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def replay(src: Path, recs: list[Record], sink, hole: int = 2**20) -> None:
    """Write `recs` again with torch's writer into `sink` (a path or an open file); records
    bigger than `hole` are written as holes (torch's write_record_metadata)."""
    w = torch._C.PyTorchFileWriter(str(sink) if isinstance(sink, Path) else sink, False, 64)
    for name, off, size in recs:
        name = name.split("/", 1)[1]
        if name == ".data/serialization_id":
            continue  # torch writes its own
        if size > hole:
            w.write_record_metadata(name, size)
        else:
            w.write_record(name, read_at(src, off, size), size)
    w.write_end_of_file()


def assert_same_bytes(
    ours: Path, theirs: Path, recs: list[Record], start: int = 0, end: int = 0, hole: int = 2**20
) -> None:
    """Bytes [start, end) (default: the whole files) equal in both, but for the serialization
    id's digits (torch hashes CRCs that are not computed) and the data of records over `hole`."""
    if not end:
        end = ours.stat().st_size
        assert theirs.stat().st_size == end
    skip = sorted((off, size) for name, off, size in recs if size > hole or name.endswith("serialization_id"))
    pos = start
    for off, size in skip + [(end, 0)]:
        assert read_at(ours, pos, off - pos) == read_at(theirs, pos, off - pos), f"bytes {pos}..{off} differ"
        pos = off + size


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(7, generator=g),
        "int64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
        "view": torch.arange(20.0)[5:9],
        "mask": torch.tensor([True, False, True]),
    }


def megatron_like(values: dict) -> dict:
    """A rank file's shape: args with dtypes and Nones, nested chunks, an OrderedDict, a tensor twice."""
    args = argparse.Namespace(
        params_dtype=BFLOAT16 if isinstance(values["bf16"], TensorRef) else torch.bfloat16,
        main_grads_dtype=torch.float32,
        tp=2,
        pp=None,
        vocab=[1, 2],
    )
    return {
        "args": args,
        "checkpoint_version": 3.0,
        "iteration": 0,
        "model": {"decoder": dict(values), "none": None},
        "optimizer": collections.OrderedDict(again=values["bf16"]),
        "rng_state": None,
    }


def load(path) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(path, weights_only=True)


def assert_equal(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, argparse.Namespace):
        assert vars(a) == vars(b)
    else:
        assert a == b


def assert_lists_what_torch_lists(path: Path, start: int = 0, length: int = 0) -> LazyTorchFile:
    """Our zip reader against `torch._C.PyTorchFileReader` (what LazyTorchFile used before):
    the same records at the same data offsets, sizes as zipfile reads them, the same stubs."""
    theirs = torch._C.PyTorchFileReader(io.BytesIO(read_at(path, start, length)) if length else str(path))
    with open(path, "rb") as f:
        ours = _zip_records(f.fileno(), start, length or path.stat().st_size)
    assert {n: at for n, (at, _) in ours.items()} == {
        r: start + theirs.get_record_offset(r) for r in theirs.get_all_records()
    }
    assert sorted((at, size) for at, size in ours.values()) == [r[1:] for r in records(path, start, length)]
    lazy = LazyTorchFile(path, PositionedReader(), start, length or None)
    assert lazy.obj == _StubUnpickler(io.BytesIO(theirs.get_record("data.pkl"))).load()
    return lazy


def assert_reads_bit_exact(lazy: LazyTorchFile, refs: dict, values: dict) -> None:
    for k, v in values.items():
        got = lazy.read(refs[k])
        assert got.dtype == v.dtype and got.shape == v.shape and raw(got) == raw(v), k


def write_with_add(path, values: dict) -> dict:
    w = StreamingTorchSave(path)
    refs = {k: w.add(v) for k, v in values.items()}
    w.finish(megatron_like(refs))
    return refs


def test_add_writes_what_torch_writes(tmp_path):
    values = tensors()
    write_with_add(tmp_path / "model_optim_rng.pt", values)
    # torch.save stores a view's whole storage; the writer stores only the view's bytes
    torch.save(megatron_like({k: v.clone() for k, v in values.items()}), tmp_path / "saved.pt")
    (tmp_path / "torch").mkdir()
    recs = records(tmp_path / "model_optim_rng.pt")
    replay(tmp_path / "model_optim_rng.pt", recs, tmp_path / "torch" / "model_optim_rng.pt")
    assert_same_bytes(tmp_path / "model_optim_rng.pt", tmp_path / "torch" / "model_optim_rng.pt", recs)

    names = [n for n, _, _ in recs]
    assert names[: len(values)] == [f"model_optim_rng/data/{i}" for i in range(len(values))]
    assert names[len(values) :] == [
        f"model_optim_rng/{n}"
        for n in ("data.pkl", ".format_version", ".storage_alignment", "byteorder", "version", ".data/serialization_id")
    ]
    saved = records(tmp_path / "saved.pt")
    assert sorted(n.split("/", 1)[1] for n in names) == sorted(n.split("/", 1)[1] for n, _, _ in saved)
    pkl = [
        read_at(p, off, size)
        for p, rs in ((tmp_path / "model_optim_rng.pt", recs), (tmp_path / "saved.pt", saved))
        for n, off, size in rs
        if n.endswith("/data.pkl")
    ]
    assert pkl[0] == pkl[1]  # the pickle torch.save writes, record keys included
    assert all(off % ALIGN == 0 for _, off, _ in recs)

    assert_equal(load(tmp_path / "model_optim_rng.pt"), megatron_like(values))


def test_lazy_reader_reads_records(tmp_path):
    values = tensors()
    write_with_add(tmp_path / "m.pt", values)
    lazy = LazyTorchFile(tmp_path / "m.pt", PositionedReader())
    refs = lazy.obj["model"]["decoder"]
    for k, v in values.items():
        assert refs[k].dtype == v.dtype and refs[k].shape == tuple(v.shape)
        assert_equal(lazy.read(refs[k]), v.contiguous())
        path, start, n = lazy.range(refs[k])
        assert start % ALIGN == 0 and read_at(path, start, n) == raw(v)
    assert lazy.obj["args"].params_dtype == torch.bfloat16 and lazy.obj["args"].pp is None
    assert lazy.obj["optimizer"]["again"] is refs["bf16"]


def test_reserve_then_pwrite(tmp_path):
    values = tensors()
    w = StreamingTorchSave(tmp_path / "r.pt")
    refs = {}
    for k, v in values.items():
        refs[k], at = w.reserve(v.nbytes, v.dtype, tuple(v.shape))
        assert refs[k].stride == tuple(v.contiguous().stride()) == contiguous_stride(v.shape)
        os.pwrite(w.fileno(), raw(v), at)
    with pytest.raises(ValueError):
        w.reserve(3, FLOAT32, (1,))
    w.finish(megatron_like(refs))
    assert_equal(load(tmp_path / "r.pt"), megatron_like(values))
    write_with_add(tmp_path / "a" / "r.pt", values)  # the very file that add() writes
    assert_same_bytes(tmp_path / "r.pt", tmp_path / "a" / "r.pt", records(tmp_path / "r.pt"))


def test_archive_appended_to_an_open_file(tmp_path):
    """A DCP `.distcp`: items back to back after other bytes, offsets relative to each item."""
    path, items = tmp_path / "__0_0.distcp", []
    with open(path, "wb") as f:
        f.write(b"x" * 13)
        for t in (torch.arange(5, dtype=torch.float32), torch.ones(2, 3, dtype=torch.bfloat16)):
            start = f.tell()
            w = StreamingTorchSave(f)
            ref, at = w.reserve(t.nbytes, t.dtype, tuple(t.shape))
            assert (at - start) % ALIGN == 0
            os.pwrite(w.fileno(), raw(t), at)
            w.finish(ref)
            items.append((t, start, f.tell() - start))
        f.write(b"tail")
    assert read_at(path, items[1][1] + items[1][2], 10) == b"tail"
    for t, start, length in items:
        lazy = assert_lists_what_torch_lists(path, start, length)
        assert_equal(lazy.read(lazy.obj), t)
        assert_equal(load(io.BytesIO(read_at(path, start, length))), t)
    t, start, length = items[1]
    recs = records(path, start, length)
    assert {n.split("/")[0] for n, _, _ in recs} == {"archive"}
    with open(tmp_path / "torch.distcp", "wb") as f:  # the same item written by torch's writer
        f.write(read_at(path, 0, start))
        replay(path, recs, f)
    assert (tmp_path / "torch.distcp").stat().st_size == start + length
    assert_same_bytes(path, tmp_path / "torch.distcp", recs, start, start + length)


def test_zip_reader_on_torch_save_files(tmp_path):
    """torch.save's own files: a view (its whole storage is stored), 0-d, empty, args."""
    values = tensors()
    torch.save(megatron_like(values), tmp_path / "saved.pt")
    lazy = assert_lists_what_torch_lists(tmp_path / "saved.pt")
    assert_reads_bit_exact(lazy, lazy.obj["model"]["decoder"], values)
    assert lazy.obj["model"]["decoder"]["view"].offset == 5 and vars(lazy.obj["args"])["tp"] == 2


def test_zip_reader_on_our_files(tmp_path):
    values = tensors()
    write_with_add(tmp_path / "m.pt", values)
    lazy = assert_lists_what_torch_lists(tmp_path / "m.pt")
    assert_reads_bit_exact(lazy, lazy.obj["model"]["decoder"], values)


def test_zip_reader_on_a_region(tmp_path):
    """torch.save into a buffer, the buffer appended to a file between other bytes (a DCP item)."""
    values, buf = tensors(), io.BytesIO()
    torch.save(values, buf)
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"x" * 1000 + buf.getvalue() + b"PK\x05\x06 tail")
    lazy = assert_lists_what_torch_lists(path, 1000, len(buf.getvalue()))
    assert_reads_bit_exact(lazy, lazy.obj, values)
    path.write_bytes(b"x" * 1000 + buf.getvalue()[:-1])
    with pytest.raises(UserError, match=rf"{path} bytes 1000\.\.\d+: not a readable torch checkpoint \(truncated"):
        LazyTorchFile(path, PositionedReader(), 1000, len(buf.getvalue()))


def test_unreadable_files_are_user_errors(tmp_path):
    values = tensors()
    torch.save(values, tmp_path / "ok.pt")
    data = (tmp_path / "ok.pt").read_bytes()
    for cut in range(0, len(data), 23):
        (tmp_path / "cut.pt").write_bytes(data[:cut])
        with pytest.raises(UserError, match=r"cut.pt: not a readable torch checkpoint \("):
            LazyTorchFile(tmp_path / "cut.pt", PositionedReader())
    (tmp_path / "text.pt").write_text("not a zip\n" * 50)
    with pytest.raises(UserError, match=r"text.pt: not a readable torch checkpoint \(no zip end-of-central"):
        LazyTorchFile(tmp_path / "text.pt", PositionedReader())
    with zipfile.ZipFile(tmp_path / "deflated.pt", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("deflated/data.pkl", pickle.dumps({"a": 1}))
    with pytest.raises(UserError, match=r"\(record deflated/data.pkl is compressed \(method 8\)"):
        LazyTorchFile(tmp_path / "deflated.pt", PositionedReader())
    with pytest.raises(UserError, match=r"missing.pt: not a readable torch checkpoint \("):
        LazyTorchFile(tmp_path / "missing.pt", PositionedReader())
    w = StreamingTorchSave(tmp_path / "lost.pt")
    w.finish(TensorRef(StorageRef("7", FLOAT32, 1), 0, (1,), (1,)))  # a stub whose record is not there
    lazy = LazyTorchFile(tmp_path / "lost.pt", PositionedReader())
    with pytest.raises(UserError, match=r"lost.pt: record data/7 is missing \(corrupt checkpoint\)"):
        lazy.read(lazy.obj)


def test_appending_mode_is_refused(tmp_path):
    with open(tmp_path / "x.distcp", "ab") as f, pytest.raises(ValueError):
        StreamingTorchSave(f)


def test_zip64_record_and_offsets_past_4gib(tmp_path):
    """A record of >= 4 GiB and records behind it, as miniz writes them (sparse: no data is written)."""
    big = 2**32 + 5
    small = torch.arange(4, dtype=torch.int32)
    w = StreamingTorchSave(tmp_path / "big.pt")
    huge, at = w.reserve(big, torch.uint8, (big,))
    tail = w.add(small)
    empty = w.add(torch.zeros(0))
    w.finish({"huge": huge, "tail": tail, "empty": empty})
    assert at % ALIGN == 0
    recs = records(tmp_path / "big.pt")
    assert recs[1][1] > 2**32 and all(off % ALIGN == 0 for _, off, _ in recs)
    (tmp_path / "t").mkdir()
    replay(tmp_path / "big.pt", recs, tmp_path / "t" / "big.pt")
    assert_same_bytes(tmp_path / "big.pt", tmp_path / "t" / "big.pt", recs)
    lazy = assert_lists_what_torch_lists(tmp_path / "big.pt")
    assert lazy.range(lazy.obj["huge"]) == (tmp_path / "big.pt", at, big)
    assert_equal(lazy.read(lazy.obj["tail"]), small)
    assert lazy.read(lazy.obj["empty"]).shape == (0,)
    reader = torch._C.PyTorchFileReader(str(tmp_path / "big.pt"))
    assert reader.get_record_offset("data/1") == recs[1][1] and reader.get_record("data/1") == small.numpy().tobytes()


def test_module_writer_and_reader_need_no_torch(tmp_path):
    torch.save(megatron_like(tensors()), tmp_path / "saved.pt")
    code = (
        "import os, sys; from pathlib import Path; "
        "from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave; "
        "from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile; "
        "from megatron_bridge.convert.formats.safetensors_io import PositionedReader; "
        "from megatron_bridge.convert.formats.dtypes import BFLOAT16; "
        f"w = StreamingTorchSave({str(tmp_path / 'n.pt')!r}); r, at = w.reserve(4, BFLOAT16, (2,)); "
        "os.pwrite(w.fileno(), bytes([0x80, 0x3f, 0, 0x40]), at); w.finish({'w': r, 'dtype': BFLOAT16}); "
        f"n = LazyTorchFile(Path({str(tmp_path / 'n.pt')!r}), PositionedReader()); "
        f"s = LazyTorchFile(Path({str(tmp_path / 'saved.pt')!r}), PositionedReader()); "
        "print(n.range(n.obj['w'])[1:] + s.range(s.obj['model']['decoder']['fp32'])[1:]); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[3], capture_output=True, text=True
    ).stdout
    n, saved = (LazyTorchFile(tmp_path / f, PositionedReader()) for f in ("n.pt", "saved.pt"))
    assert out.strip() == str(n.range(n.obj["w"])[1:] + saved.range(saved.obj["model"]["decoder"]["fp32"])[1:])
    loaded = load(tmp_path / "n.pt")
    assert loaded["dtype"] is torch.bfloat16 and loaded["w"].tolist() == [1.0, 2.0]


def pickled(obj) -> bytes:
    buf = io.BytesIO()
    TorchPickler(buf).dump(obj)
    return buf.getvalue()


def test_dtypes_pickle_as_torch_dtypes():
    storage = torch.storage._dtype_to_storage_type_map()
    storable = {name: d for name, d in BY_NAME.items() if d.torch in storage}
    assert _STORAGE_TYPE == {name: storage[d.torch] for name, d in storable.items()}
    # fp8 is a source dtype only: block-quantised weights are dequantised before anything is written
    assert set(BY_NAME) - set(storable) == {"float8_e4m3fn"}
    mixed = [BFLOAT16, BY_NAME["bfloat16"], torch.bfloat16, FLOAT32, Global("torch", "float16")]
    back = pickle.loads(pickled(mixed))
    assert back == [torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float16]
    assert pickled([BFLOAT16, BFLOAT16, FLOAT32]) == pickle.dumps([torch.bfloat16, torch.bfloat16, torch.float32], 2)


def test_instance_stand_in_is_the_dcp_dataclass():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    real = ChunkStorageMetadata(offsets=torch.Size([1, 0]), sizes=torch.Size([1, 4]))
    stand_in = Instance(
        "torch.distributed.checkpoint.metadata",
        "ChunkStorageMetadata",
        {"offsets": torch_size((1, 0)), "sizes": Reduce(Global("torch", "Size"), ((1, 4),))},
    )
    back = pickle.loads(pickled(stand_in))
    assert back == real and type(back.offsets) is torch.Size
    assert pickled(stand_in) == pickle.dumps(real, protocol=2)
