"""The byte-move conversion (`convert/bytemove/`) against the tensor path it replaces.

`mbr convert` from an HF directory without a dtype cast lays shards out straight from the
safetensors bytes (copy_file_range, gathered writes, zero rows); export and reshard move
bytes too. The tensor path (read, `Mapping.shard`, `torch.save`-format records) still
serves casts, and `MBR_CONVERT_DIRECT=0` forces it, so the two are compared file by file
here, for all three commands (reshard: TP merges and splits, a band across source shards,
torch_dist in and out, a damaged record still refused): every output
byte must be the same (only DCP's random `save_id` and the manifest's paths differ), for
layouts that exercise each transform's blocks — fused QKV with whole and split KV groups,
row-parallel bands, vocab padding rows, experts over EP, virtual pipeline chunks. The
torch_dist metadata, pickled torch-free from stand-ins, must load into torch's own classes
equal to what torch builds.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.bytemove import copier, direct
from megatron_bridge.convert.bytemove.direct_export import DirectExport
from megatron_bridge.convert.bytemove.direct_reshard import DirectReshard, compose
from megatron_bridge.convert.bytemove.pieces import Band, Interleave, Span, Zeros, pieces
from megatron_bridge.convert.sources.readers import open_checkpoint

CASES = [
    ("llama", ["format=torch", "parallel.tp=2", "parallel.pp=2"]),
    ("llama", ["format=torch", "parallel.tp=4"]),  # 2 KV groups over 4 ranks: half a group each
    ("llama", ["format=torch", "parallel.pp=2", "parallel.vpp=2", "parallel.tp=2"]),
    ("qwen2", ["format=torch", "parallel.tp=2"]),  # qkv biases: 1-D fused blocks
    ("mixtral", ["format=torch", "parallel.ep=2", "parallel.tp=2"]),
    ("llama", ["format=torch_dist"]),
    ("qwen2_moe", ["format=torch_dist"]),
]
# GPT-OSS's stacked experts: strided gathers / scatters on the byte path, whole stacked
# tensors put together from every expert on the tensor path
STACKED = [
    ("gpt_oss", ["format=torch", "parallel.ep=2", "parallel.pp=2"]),
    ("gpt_oss", ["format=torch_dist", "parallel.tp=2", "parallel.ep=2", "parallel.etp=1"]),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_bridge.runtime.tiny import make_tiny

    base = tmp_path_factory.mktemp("hf")
    return {f: make_tiny(f, base / f) for f in ("llama", "qwen2", "mixtral", "qwen2_moe", "gpt_oss")}


def convert(src: Path, dst: Path, args, monkeypatch, direct_on: bool) -> None:
    monkeypatch.setattr(direct, "ENABLED", direct_on)
    assert mbr(["convert", f"src={src}", f"dst={dst}", "progress=off", *args]) == 0


def dcp_metadata(path: Path):
    md = pickle.loads(path.read_bytes())
    md.storage_meta.save_id = None
    return md


def assert_same_output(a: Path, b: Path) -> None:
    files_a = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    for rel in files_a:
        if rel.endswith(".metadata"):
            assert dcp_metadata(a / rel) == dcp_metadata(b / rel), rel
        elif rel == "mbr_manifest.json":
            ma, mb = (json.loads((d / rel).read_text()) for d in (a, b))
            assert ma["tensors"] == mb["tensors"] and ma["files"] == mb["files"]
        else:
            assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.parametrize("family,args", CASES + STACKED, ids=[f"{f}-{'-'.join(a)}" for f, a in CASES + STACKED])
def test_direct_equals_tensor_path(tiny, tmp_path, monkeypatch, family, args):
    convert(tiny[family], tmp_path / "direct", args, monkeypatch, True)
    convert(tiny[family], tmp_path / "tensors", args, monkeypatch, False)
    assert_same_output(tmp_path / "direct", tmp_path / "tensors")


def test_user_space_fallback(tiny, tmp_path, monkeypatch):
    """Where copy_file_range is refused (another filesystem, an old kernel), the same bytes
    are copied through user space."""
    import errno

    def refuse(*_):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(copier.os, "copy_file_range", refuse)
    args = ["format=torch", "parallel.tp=2", "parallel.pp=2"]
    convert(tiny["llama"], tmp_path / "fallback", args, monkeypatch, True)
    monkeypatch.undo()
    convert(tiny["llama"], tmp_path / "tensors", args, monkeypatch, False)
    assert_same_output(tmp_path / "fallback", tmp_path / "tensors")


def test_pieces_of_blocks():
    """Row ranges become one contiguous span, column bands a strided band, padding zeros."""
    from megatron_bridge.bridge.mapping import COLUMN, ROW, VOCAB
    from megatron_bridge.bridge.shards import Shapes, Shard
    from megatron_bridge.convert.formats.dtypes import BFLOAT16
    from megatron_bridge.convert.formats.safetensors_io import TensorInfo

    w = TensorInfo("w", BFLOAT16, (8, 6), Path("f"), 100, 100 + 8 * 6 * 2)
    shapes = Shapes(num_attention_heads=2, num_query_groups=1, head_dim=3, vocab_size=8, padded_vocab_size=12)
    assert pieces(COLUMN.blocks([w.shape], Shard(1, 2), shapes), [w]) == [Span(Path("f"), 148, 48)]
    assert pieces(ROW.blocks([w.shape], Shard(1, 2), shapes), [w]) == [Band(Path("f"), 100, 8, 12, 6, 12)]
    assert pieces(VOCAB.blocks([w.shape], Shard(1, 2), shapes), [w]) == [
        Span(Path("f"), 172, 24),
        Zeros(48),
    ]


def test_dcp_metadata_is_torchs(tmp_path):
    """`.metadata` written from stand-ins loads as torch's own Metadata, equal to the one
    torch's classes build for the same chunks, and DCP_VERSION is torch's."""
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    from megatron_bridge.convert.formats.dist_ckpt import DCP_VERSION, DistLocation, DistWriter

    assert DCP_VERSION == CURRENT_DCP_VERSION
    w = DistWriter(tmp_path)
    t = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    for layer in range(2):
        w.add(
            DistLocation("decoder.layers.w", (layer,), (2,)),
            t.dtype,
            (3, 4),
            lambda item, shape: item.add(t.reshape(shape)),
        )
    w.add_object(DistLocation("decoder.layers.x._extra_state", (0,), (2,)))
    w.finish({"iteration": 0})
    got = pickle.loads((tmp_path / ".metadata").read_bytes())  # (FileSystemReader would set a load_id)
    infos = [got.storage_data[k] for k in sorted(got.storage_data, key=lambda k: got.storage_data[k].offset)]
    chunks = [ChunkStorageMetadata(offsets=torch.Size([i, 0, 0]), sizes=torch.Size([1, 3, 4])) for i in range(2)]
    want = Metadata(
        state_dict_metadata={
            "decoder.layers.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16), torch.Size([2, 3, 4]), chunks
            ),
            "decoder.layers.x._extra_state/shard_0_2": BytesStorageMetadata(),
        },
        storage_data={
            MetadataIndex("decoder.layers.w", torch.Size([0, 0, 0]), 0): _StorageInfo(
                "__0_0.distcp", 0, infos[0].length
            ),
            MetadataIndex("decoder.layers.w", torch.Size([1, 0, 0]), 1): _StorageInfo(
                "__0_0.distcp", infos[1].offset, infos[1].length
            ),
            MetadataIndex("decoder.layers.x._extra_state/shard_0_2"): _StorageInfo(
                "__0_0.distcp", infos[2].offset, infos[2].length
            ),
        },
        storage_meta=StorageMeta(save_id=got.storage_meta.save_id),
        version=CURRENT_DCP_VERSION,
    )
    assert got == want
    assert torch.load(tmp_path / "common.pt", weights_only=True) == {"iteration": 0}


def run_without_torch(args) -> None:
    """`mbr ARGS` in a fresh interpreter, which must succeed and never import torch (nor numpy,
    except `mbr convert`'s check for NaN/inf in the source bytes, convert/formats/finite.py,
    which runs on the CRC thread)."""
    code = (
        "import sys; from megatron_bridge.cli import main; "
        f"rc = main({list(args) + ['progress=off']!r}); assert rc == 0, rc; "
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:3]; "
        + ("" if args[0] == "convert" else "assert 'numpy' not in sys.modules")
    )
    env = {k: v for k, v in os.environ.items() if k != "MBR_CONVERT_DIRECT"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_convert_never_imports_torch(tiny, tmp_path):
    """The point of the byte path: `mbr convert` from HF runs without importing torch."""
    run_without_torch(["convert", f"src={tiny['llama']}", f"dst={tmp_path / 'o'}", "format=torch", "parallel.tp=2"])


@pytest.mark.parametrize("family,args", CASES + STACKED, ids=[f"{f}-{'-'.join(a)}" for f, a in CASES + STACKED])
def test_direct_export_equals_tensor_path(tiny, tmp_path, monkeypatch, family, args):
    """Export reads HF tensors back out of the records as byte ranges (row-parallel weights
    interleaved from their TP shards): the same files as the tensor path, byte for byte."""
    convert(tiny[family], tmp_path / "ckpt", args, monkeypatch, True)
    for name, on in (("direct", True), ("tensors", False)):
        monkeypatch.setattr(direct, "ENABLED", on)
        src = open_checkpoint(tmp_path / "ckpt", None)
        assert (DirectExport.make_plan(src) is not None) == on  # each export takes the path it is meant to
        src.close()
        assert mbr(["export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / name}", "progress=off"]) == 0
    assert_same_output(tmp_path / "direct", tmp_path / "tensors")


def test_export_and_reshard_never_import_torch(tiny, tmp_path):
    """Export of either format, and a reshard (per-rank tp2 -> torch_dist tp1), run without
    importing torch, as convert does (that import alone is ~2 s of start-up)."""
    for fmt in ("torch", "torch_dist"):
        assert (
            mbr(
                [
                    "convert",
                    f"src={tiny['llama']}",
                    f"dst={tmp_path / fmt}",
                    f"format={fmt}",
                    "parallel.tp=2",
                    "progress=off",
                ]
            )
            == 0
        )
        run_without_torch(["export", f"src={tmp_path / fmt}", f"dst={tmp_path / (fmt + '-hf')}"])
    run_without_torch(["reshard", f"src={tmp_path / 'torch'}", f"dst={tmp_path / 'r'}", "format=torch_dist"])


def test_stacked_experts_convert_and_export_without_torch(tiny, tmp_path):
    """GPT-OSS's transposed, interleaved expert tensors are gathered and scattered with the
    standard library: neither direction imports torch (nor export numpy)."""
    layout = ["parallel.ep=2", "parallel.pp=2"]
    run_without_torch(["convert", f"src={tiny['gpt_oss']}", f"dst={tmp_path / 'c'}", "format=torch", *layout])
    run_without_torch(["export", f"src={tmp_path / 'c'}", f"dst={tmp_path / 'hf'}"])
    from safetensors.torch import load_file

    a = load_file(str(tiny["gpt_oss"] / "model.safetensors"))
    b = load_file(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].equal(b[k]) for k in a)


# --- reshard as byte moves (direct_reshard.py): both paths, every output byte compared ---

RESHARD = [  # (family, convert args, reshard args)
    ("llama", ["format=torch", "parallel.tp=2", "parallel.pp=2"], ["parallel.tp=1", "parallel.pp=4"]),
    ("llama", ["format=torch", "parallel.tp=2"], ["parallel.tp=4", "parallel.pp=2"]),
    ("llama", ["format=torch", "parallel.tp=4"], ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]),
    ("llama", ["format=torch", "parallel.tp=2"], ["format=torch_dist"]),
    ("llama", ["format=torch_dist"], ["parallel.tp=4"]),
    ("qwen2", ["format=torch", "parallel.tp=2"], ["parallel.tp=1"]),
    ("mixtral", ["format=torch", "parallel.ep=2", "parallel.tp=2"], ["parallel.ep=1", "parallel.tp=4"]),
]


def run(*args: str) -> None:
    assert mbr([*args, "progress=off"]) == 0


@pytest.mark.parametrize("family,conv,resh", RESHARD, ids=[f"{f}-{'-'.join(c + r)}" for f, c, r in RESHARD])
def test_byte_reshard_equals_tensor_path(tiny, tmp_path, monkeypatch, family, conv, resh):
    run("convert", f"src={tiny[family]}", f"dst={tmp_path / 'a'}", *conv)
    for name, on in (("bytes", True), ("tensors", False)):
        monkeypatch.setattr(direct, "ENABLED", on)
        src = open_checkpoint(tmp_path / "a", None)
        assert (DirectReshard.make_plan(src) is not None) == on  # each run takes the path it is meant to
        src.close()
        run("reshard", f"src={tmp_path / 'a'}", f"dst={tmp_path / name}", *resh)
    assert_same_output(tmp_path / "bytes", tmp_path / "tensors")


def test_cast_and_stacked_experts_take_the_tensor_path(tiny, tmp_path):
    """Declared limits: a dtype cast needs values, stacked experts are strided views of
    strided views; the plan declines both (and the tensor path gives the same as above)."""
    from megatron_bridge.convert.formats.dtypes import FLOAT16

    run("convert", f"src={tiny['llama']}", f"dst={tmp_path / 'a'}", "format=torch", "parallel.tp=2")
    run("convert", f"src={tiny['gpt_oss']}", f"dst={tmp_path / 'g'}", "format=torch", "parallel.ep=2")
    for path, dtype, planned in (("a", None, True), ("a", FLOAT16, False), ("g", None, False)):
        src = open_checkpoint(tmp_path / path, dtype)
        assert (src.tensors[next(iter(src.tensors))][1] != FLOAT16) and (
            DirectReshard.make_plan(src) is not None
        ) == planned
        src.close()


def test_damaged_record_is_refused(tiny, tmp_path, capsys):
    """A flipped byte inside a record is found from the source bytes, after the copy, and
    nothing is published."""
    run("convert", f"src={tiny['llama']}", f"dst={tmp_path / 'a'}", "format=torch", "parallel.tp=2")
    f = next((tmp_path / "a").rglob("*.pt"))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40
    f.write_bytes(bytes(data))
    import json

    from megatron_bridge.convert.formats.manifest import MANIFEST

    man = json.loads((tmp_path / "a" / MANIFEST).read_text())
    man.pop("file_crc32", None)  # past the whole-file check: the tensor check must catch it
    (tmp_path / "a" / MANIFEST).write_text(json.dumps(man))
    rc = mbr(["reshard", f"src={tmp_path / 'a'}", f"dst={tmp_path / 'b'}", "parallel.tp=1", "progress=off"])
    assert rc != 0 and not (tmp_path / "b").exists()
    assert "does not match its checksum" in capsys.readouterr().err


def test_compose():
    """Rows and bands of an HF tensor as pieces of its records: row-split and column-split."""
    rows = [Span("r0", 100, 4 * 8), Span("r1", 0, 4 * 8)]  # 8 rows of 8 bytes, split 4 / 4
    assert compose(Span("hf", 16, 32), rows, 8) == [Span("r0", 116, 16), Span("r1", 0, 16)]
    assert compose(Band("hf", 0, 8, 8, 2, 6), rows, 8) == [Band("r0", 100, 4, 8, 2, 6), Band("r1", 0, 4, 8, 2, 6)]
    cols = [Interleave(8, (("c0", 0, 4), ("c1", 50, 4)))]  # 8 rows, columns split 4 / 4 bytes
    assert compose(Span("hf", 16, 16), cols, 8) == [Interleave(2, (("c0", 8, 4), ("c1", 58, 4)))]
    assert compose(Band("hf", 0, 8, 8, 4, 8), cols, 8) == [Span("c1", 50, 32)]
    assert compose(Band("hf", 0, 8, 8, 4, 6), cols, 8) == [Band("c1", 50, 8, 4, 0, 2)]
    assert compose(Band("hf", 8, 2, 8, 2, 6), cols, 8) == [
        Interleave(2, (("c0", 4, 4), ("c1", 54, 4)), ((2, 4), (0, 2)))
    ]


@pytest.mark.parametrize(
    "family,conv,resh",
    [
        ("mixtral", ["format=torch", "parallel.ep=2", "parallel.tp=2"], ["parallel.ep=1", "parallel.tp=4"]),
        ("gpt_oss", ["format=torch_dist", "parallel.tp=2", "parallel.ep=2", "parallel.etp=1"], ["format=torch"]),
    ],
    ids=["mixtral-bands", "gpt_oss-stacked"],
)
def test_workers_write_the_same_bytes(tiny, tmp_path, family, conv, resh):
    """convert, export and reshard on the byte path give the same files whatever `workers=`
    (1: every write in the caller's thread; 3: more workers than this machine's cores, so
    tasks finish out of order)."""
    for w in (1, 3):
        out = tmp_path / f"w{w}"
        run("convert", f"src={tiny[family]}", f"dst={out / 'conv'}", *conv, f"workers={w}")
        run("export", f"src={out / 'conv'}", f"dst={out / 'hf'}", f"workers={w}")
        run("reshard", f"src={out / 'conv'}", f"dst={out / 'resh'}", *resh, f"workers={w}")
    for d in ("conv", "hf", "resh"):
        assert_same_output(tmp_path / "w1" / d, tmp_path / "w3" / d)


def test_workers_must_not_be_negative(tiny, tmp_path, capsys):
    assert mbr(["convert", f"src={tiny['llama']}", f"dst={tmp_path / 'x'}", "workers=-1"]) != 0
    assert "workers=-1" in capsys.readouterr().err and not (tmp_path / "x").exists()
