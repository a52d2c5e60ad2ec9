"""`DistReader` reads DCP's `.metadata` without torch, into stand-ins (`dist_read`).

Export moves a chunk's bytes by the metadata alone, so loading it must not import torch or
`torch.distributed.checkpoint`. The stand-ins must see what torch's own `FileSystemReader`
sees, for the checkpoints `mbr convert` writes and for ones torch's DCP writes (a key in
two chunks, dtypes besides bf16, a bytes object, megatron-core's extra `all_local_plans`),
and a `.metadata` naming anything else must be refused before it is called.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.formats.dist_ckpt import MEGATRON_METADATA, DistLocation
from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.safetensors_io import PositionedReader
from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile
from megatron_bridge.errors import UserError


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """The torch_dist directory of `mbr convert` of the tiny llama."""
    from megatron_bridge.runtime.tiny import make_tiny

    base = tmp_path_factory.mktemp("dist")
    hf = make_tiny("llama", base / "hf")
    assert mbr(["convert", f"src={hf}", f"dst={base / 'out'}", "progress=off"]) == 0
    return base / "out" / "release"


@pytest.fixture(scope="module")
def converted_in_files(tmp_path_factory) -> Path:
    """The same, its chunks spread over three `.distcp` files (dist_ckpt.data_files: one per
    BYTES_PER_FILE, here a third of the model), as a big model's are."""
    from megatron_bridge.convert.formats import dist_ckpt
    from megatron_bridge.runtime.tiny import make_tiny

    base = tmp_path_factory.mktemp("dist3")
    hf = make_tiny("llama", base / "hf")
    nbytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist_ckpt, "BYTES_PER_FILE", nbytes // 3 + 1)
        assert mbr(["convert", f"src={hf}", f"dst={base / 'out'}", "progress=off", "workers=2"]) == 0
    release = base / "out" / "release"
    assert sorted(p.name for p in release.glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    sizes = [p.stat().st_size for p in release.glob("*.distcp")]
    assert max(sizes) < 2 * min(sizes)  # each chunk went to the emptiest file
    return release


@pytest.fixture(scope="module")
def dcp_saved(tmp_path_factory) -> Path:
    """A checkpoint written by torch's DCP on one process: "w" as two column chunks (the
    container megatron-core uses for several shards of a key on one rank), float32, int64,
    a bytes object; then the save plans added to `.metadata` as megatron-core's save does."""
    import torch
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
        LocalShardsContainer,
    )
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    path = tmp_path_factory.mktemp("dcp")
    w = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    halves = [ShardedTensor.from_rank_offsets("w", w[:, 3 * i : 3 * i + 3].clone(), (1, i, 2)) for i in range(2)]
    sd = {
        "w": LocalShardsContainer([CheckpointableShardedTensor.from_sh_ten(h) for h in halves]),
        "f": torch.linspace(0, 1, 5),
        "i": torch.arange(7),
        "blob": io.BytesIO(b"abc"),
    }
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    planner = DefaultSavePlanner()
    planner.set_up_planner(sd, is_coordinator=True)
    md = pickle.loads((path / ".metadata").read_bytes())
    md.all_local_plans = [planner.create_local_plan()]  # megatron: global_metadata.all_local_plans = ...
    (path / ".metadata").write_bytes(pickle.dumps(md))
    (path / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
    return path


def plain(md):
    """What a reader takes from a Metadata (torch's or the stand-ins) as plain values."""
    entries = {
        k: (str(e.properties.dtype), tuple(e.size), [(tuple(c.offsets), tuple(c.sizes)) for c in e.chunks])
        if hasattr(e, "chunks")
        else "bytes"
        for k, e in md.state_dict_metadata.items()
    }
    storage = {
        (i.fqn, None if i.offset is None else tuple(i.offset), i.index): (
            s.relative_path,
            s.offset,
            s.length,
            s.transform_descriptors,
        )
        for i, s in md.storage_data.items()
    }
    return entries, storage, md.version, md.storage_meta.save_id, str(md.storage_meta.checkpoint_id)


def locations(reader: DistReader):
    """Every tensor location: a layer of a stacked key, or a whole key."""
    for key, e in reader.md.state_dict_metadata.items():
        if hasattr(e, "chunks"):
            if key.startswith("decoder.layers."):
                yield from (DistLocation(key, (layer,), (e.size[0],)) for layer in range(e.size[0]))
            else:
                yield DistLocation(key)


def reference(path: Path):
    """Every tensor key as torch's DCP loads it (whole global tensors)."""
    import torch
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(path).read_metadata()
    sd = {
        k: torch.zeros(tuple(e.size), dtype=e.properties.dtype)
        for k, e in md.state_dict_metadata.items()
        if hasattr(e, "chunks")
    }
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return md, sd


@pytest.mark.parametrize("which", ["converted", "converted_in_files", "dcp_saved"])
def test_metadata_reads_and_regions_match_torch(request, which):
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    path = request.getfixturevalue(which)
    md, full = reference(path)
    reader = DistReader(path, PositionedReader())
    assert plain(reader.md) == plain(md)
    singles = 0
    for loc in locations(reader):
        want = full[loc.key][loc.offsets] if loc.offsets else full[loc.key]
        assert torch.equal(reader.read(loc), want), loc
        region = reader.single_chunk(loc)
        entry = md.state_dict_metadata[loc.key]
        chunks = [c for c in entry.chunks if tuple(c.offsets[: len(loc.offsets)]) == loc.offsets]
        if len(chunks) > 1:
            assert region is None, loc
            continue
        singles += 1
        info = md.storage_data[MetadataIndex(loc.key, chunks[0].offsets)]
        assert region == (
            path / info.relative_path,
            info.offset,
            info.length,
            tuple(chunks[0].sizes),
            entry.properties.dtype,
        )
        assert reader.ranges(loc) == [region[:3]]
        item = LazyTorchFile(region.path, PositionedReader(), region.offset, region.length)
        assert (tuple(item.obj.shape), item.obj.dtype) == (region.shape, region.dtype)
        assert torch.equal(item.read(item.obj).reshape(want.shape), want)
    assert singles == (len(full) - 1 if which == "dcp_saved" else len(list(locations(reader))))


def test_part_of_a_stacked_chunk_is_not_single(dcp_saved):
    """A location inside one chunk but not the whole of it (megatron's stacked layers) is
    read by slicing, not moved as bytes."""
    reader = DistReader(dcp_saved, PositionedReader())
    loc = DistLocation("i", (2,), (7,))
    assert reader.single_chunk(loc) is None and reader.read(loc).item() == 2


@pytest.mark.parametrize("which", ["converted", "dcp_saved"])
def test_any_box_reads_what_torch_loads_and_only_its_span(request, which, monkeypatch):
    """`read_box` (what `train.init_from` reads a rank's shard with): every box of a grid
    over each tensor, across chunk borders (dcp_saved's "w" is two column chunks), equals
    that box of torch's own load; a row range of a chunk reads just its bytes."""
    import itertools

    import torch

    path = request.getfixturevalue(which)
    _, full = reference(path)
    pr = PositionedReader()
    reader = DistReader(path, pr)
    boxes = 0
    for key, want in full.items():
        cuts = [sorted({0, n // 3, n // 2, n}) for n in want.shape]
        for bounds in itertools.product(*[list(itertools.combinations(c, 2)) for c in cuts]):
            lo, hi = [a for a, _ in bounds], [b for _, b in bounds]
            got = reader.read_box(key, lo, hi)
            assert torch.equal(got, want[tuple(slice(a, b) for a, b in bounds)]), (key, lo, hi)
            boxes += 1
    assert boxes > 40
    key, lo, hi = ("i", [2], [5]) if which == "dcp_saved" else ("decoder.layers.mlp.linear_fc1.weight", None, None)
    size = reader.size(key)
    if lo is None:  # the first half of one layer's rows
        lo, hi = [0, 0, 0], [1, size[1] // 2, size[2]]
    seen = []
    real = pr.read_bytes
    monkeypatch.setattr(pr, "read_bytes", lambda p, start, n: (seen.append(n), real(p, start, n))[1])
    reader.read_box(key, lo, hi)
    assert seen == [torch.Size(b - a for a, b in zip(lo, hi)).numel() * full[key].element_size()], seen
    with pytest.raises(UserError, match="no box"):
        reader.read_box(key, lo, [n + 1 for n in size])


def damaged(tmp_path: Path, src: Path, data: bytes) -> Path:
    out = tmp_path / "bad"
    out.mkdir()
    (out / "metadata.json").write_text((src / "metadata.json").read_text())
    (out / ".metadata").write_bytes(data)
    return out


class _Exploit:
    def __reduce__(self):
        return os.system, ("touch pwned",)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d[: len(d) // 2], "not a readable torch_dist checkpoint"),
        (lambda d: b"not a pickle at all", "not a readable torch_dist checkpoint"),
        (lambda d: pickle.dumps({"a": 1}), "does not hold DCP's Metadata"),
        (lambda d: d.replace(b"torch\nfloat32\n", b"torch\ncomplex64\n"), "unsupported dtype torch.complex64"),
        (lambda d: pickle.dumps([_Exploit()]), "was refused: it holds a `posix.system` object"),
        (
            lambda d: d.replace(b"\n_StorageInfo\n", b"\nFileSystemReader\n"),
            "holds a `torch.distributed.checkpoint.filesystem.FileSystemReader` object",
        ),
    ],
    ids=["truncated", "garbage", "other-object", "unknown-dtype", "os-system", "foreign-class"],
)
def test_damaged_or_foreign_metadata_is_refused(tmp_path, monkeypatch, converted, edit, match):
    monkeypatch.chdir(tmp_path)
    path = damaged(tmp_path, converted, edit((converted / ".metadata").read_bytes()))
    with pytest.raises(UserError) as e:  # damaged: not readable; foreign objects: refused, never called
        DistReader(path, PositionedReader())
    assert match in str(e.value) and str(path) in str(e.value)
    assert not (tmp_path / "pwned").exists()


def test_finding_chunk_bytes_never_imports_torch(converted):
    """What export's byte path does: metadata, a chunk's item, the tensor record in it."""
    code = (
        "import sys; from pathlib import Path; "
        "from megatron_bridge.convert.formats.dist_ckpt import DistLocation; "
        "from megatron_bridge.convert.formats.dist_read import DistReader; "
        "from megatron_bridge.convert.formats.safetensors_io import PositionedReader; "
        "from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile; "
        f"pr = PositionedReader(); r = DistReader(Path({str(converted)!r}), pr); "
        "L = r.md.state_dict_metadata['decoder.layers.mlp.linear_fc2.weight'].size[0]; "
        "locs = [DistLocation('embedding.word_embeddings.weight')] + "
        "[DistLocation('decoder.layers.mlp.linear_fc2.weight', (i,), (L,)) for i in range(L)]; "
        "regions = [r.single_chunk(loc) for loc in locs]; "
        "assert all(len(r.ranges(loc)) == 1 for loc in locs); "
        "items = [LazyTorchFile(g.path, pr, g.offset, g.length) for g in regions]; "
        "assert all(f.range(f.obj)[2] == f.obj.storage.numel * g.dtype.itemsize for f, g in zip(items, regions)); "
        "assert 'torch' not in sys.modules, [m for m in sys.modules if m.startswith('torch')][:3]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
