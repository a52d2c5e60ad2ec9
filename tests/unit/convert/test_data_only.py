"""A checkpoint is data, never code; the paths it names are confined (docs/reliability.md,
"A checkpoint from a stranger"). The converter's side: its torch-free readers refuse a pickle
payload before calling it (`pickle_guard`), and every name a manifest, an index or DCP's
`.metadata` gives is a regular file inside the directory (`paths.confined`).

Every payload here is `tests/payloads.MarkerPayload`: unpickling it creates a file, so each
test also proves that nothing ran."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import threading
from pathlib import Path

import pytest

from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.manifest import Manifest
from megatron_bridge.convert.formats.paths import confined
from megatron_bridge.convert.formats.pickle_guard import CONVERTED, TRAINING
from megatron_bridge.convert.formats.safetensors_io import PositionedReader, scan_dir
from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile, scan_torch_file
from megatron_bridge.convert.sources.preflight import check_data_only
from megatron_bridge.errors import UserError
from tests.payloads import MarkerPayload, payload_in_extra_state, payload_in_rank_file, torch_bytes

REFUSED = f"was refused: it holds a `{open.__module__}.open` object"  # the payload's callable: io.open


@pytest.fixture(scope="module")
def hf(tmp_path_factory) -> Path:
    from megatron_bridge.runtime.tiny import make_tiny

    return Path(make_tiny("llama", tmp_path_factory.mktemp("hf") / "hf"))


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, hf) -> dict[str, Path]:
    """`mbr convert` of the tiny llama in both formats (copied by each test that damages one)."""
    base = tmp_path_factory.mktemp("cv")
    out = {}
    for fmt in ("torch_dist", "torch"):
        assert mbr(["convert", f"src={hf}", f"dst={base / fmt}", f"format={fmt}", "progress=off"]) == 0
        out[fmt] = base / fmt
    return out


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    return dst


# -- the pickle scan ----------------------------------------------------------------------
@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_scan_passes_tensors_and_refuses_a_payload_without_running_it(tmp_path, zipfile):
    import torch

    good, bad = tmp_path / "good.pt", tmp_path / "bad.pt"
    marker = tmp_path / "MARKER"
    state = {"w": torch.ones(3), "step": 2, "names": ["a", "b"], "opt": {"lr": 1e-3}}
    torch.save(state, good, _use_new_zipfile_serialization=zipfile)
    torch.save({**state, "x": MarkerPayload(marker)}, bad, _use_new_zipfile_serialization=zipfile)
    scan_torch_file(good, TRAINING)
    with pytest.raises(UserError, match=REFUSED) as e:
        scan_torch_file(bad, TRAINING)
    assert str(bad) in str(e.value) and "nothing of this one was loaded or run" in str(e.value)
    assert not marker.exists()


def test_scan_admits_what_training_checkpoints_hold_and_only_that(tmp_path):
    """The NumPy RNG state (ndarray) and DeepSpeed's plain records pass the training
    allowlist; a converted checkpoint's allowlist has no NumPy; an allowed name is never called."""
    import numpy as np
    import torch

    f = tmp_path / "rng.pt"
    torch.save({"numpy": np.random.get_state(), "t": torch.get_rng_state(), "set": {1, 2}}, f)
    scan_torch_file(f, TRAINING)
    with pytest.raises(UserError, match="holds a `numpy._core.multiarray._reconstruct` object"):
        scan_torch_file(f, CONVERTED)


def _memo_payload(marker: Path) -> bytes:
    """`io.open(marker, "w")` whose module and name strings are fetched from the memo."""

    def text(x: str) -> bytes:
        return pickle.SHORT_BINUNICODE + bytes([len(x.encode())]) + x.encode()

    memo = text("io") + pickle.MEMOIZE + pickle.POP + text("open") + pickle.MEMOIZE + pickle.POP
    call = pickle.BINGET + b"\x00" + pickle.BINGET + b"\x01" + pickle.STACK_GLOBAL
    args = text(str(marker)) + text("w") + pickle.TUPLE2 + pickle.REDUCE
    return pickle.PROTO + b"\x04" + memo + call + args + pickle.STOP


def test_scan_sees_a_global_hidden_behind_the_memo(tmp_path):
    """STACK_GLOBAL whose module and name strings come from the memo: a listing of the opcodes
    would not see `io.open`; the scan asks the unpickler, so it sees exactly the name the load
    would resolve."""
    marker = tmp_path / "MARKER"
    f = tmp_path / "plain.pkl"
    f.write_bytes(_memo_payload(marker))
    with pytest.raises(UserError, match=REFUSED):
        scan_torch_file(f, TRAINING)
    assert not marker.exists()


def test_lazy_reader_refuses_a_payload(tmp_path):
    marker = tmp_path / "MARKER"
    f = tmp_path / "r.pt"
    f.write_bytes(torch_bytes({"model": {"w": MarkerPayload(marker)}}))
    with pytest.raises(UserError, match=REFUSED):
        LazyTorchFile(f, PositionedReader())
    assert not marker.exists()


# -- converted checkpoints: torch_dist objects, per-rank files -------------------------------
def test_torch_dist_extra_state_payload_is_refused(outputs, tmp_path):
    """The `_extra_state` route (torch's DCP `load_bytes` would `torch.load(weights_only=False)`
    it): the preflight scan and the reader `train.init_from` uses both refuse it."""
    out = copy_of(outputs["torch_dist"], tmp_path)
    marker = tmp_path / "MARKER"
    key = payload_in_extra_state(out, marker)
    with pytest.raises(UserError, match=REFUSED):
        check_data_only(out)
    reader = DistReader(out / "release", PositionedReader())
    with pytest.raises(UserError, match=REFUSED):
        reader.read_object(key)
    assert not marker.exists()


def test_per_rank_payload_is_refused_by_preflight_export_and_reshard(outputs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = copy_of(outputs["torch"], tmp_path)
    marker = tmp_path / "MARKER"
    f = payload_in_rank_file(out, marker)
    with pytest.raises(UserError, match=REFUSED) as e:
        check_data_only(out)
    assert str(f) in str(e.value)
    for cmd in ("export", "reshard"):
        assert mbr([cmd, f"src={out}", f"dst={tmp_path / cmd}", "progress=off"]) == 2
        assert not (tmp_path / cmd).exists()
    assert not marker.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial output either


def test_clean_outputs_pass_the_preflight(outputs):
    for out in outputs.values():
        check_data_only(out)


# -- names from manifests and indexes ------------------------------------------------------
def _edit_manifest(out: Path, **fields) -> None:
    mf = out / "mbr_manifest.json"
    m = json.loads(mf.read_text())
    for k, v in fields.items():
        m[k] = v(m[k]) if callable(v) else v
    mf.write_text(json.dumps(m))


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"assets": ["../escaped.txt"]}, "names asset '../escaped.txt': an absolute path or one with '..'"),
        ({"assets": ["sub/tokenizer.json"]}, "expected a bare file name"),
        ({"files": lambda f: {**f, "/etc/passwd": 10}}, "names file '/etc/passwd': an absolute path"),
        ({"layout": lambda lay: {**lay, "tp": 0}}, "tp and pp must be positive integers"),
        ({"make_vocab_size_divisible_by": 0}, "make_vocab_size_divisible_by=0 is not a positive integer"),
    ],
    ids=["asset-dotdot", "asset-subdir", "file-absolute", "tp0", "divisor0"],
)
def test_manifest_names_and_values_are_checked(outputs, tmp_path, monkeypatch, fields, match):
    monkeypatch.chdir(tmp_path)
    out = copy_of(outputs["torch_dist"], tmp_path)
    _edit_manifest(out, **fields)
    with pytest.raises(UserError, match=match.replace("(", r"\(").replace(")", r"\)")):
        Manifest.read(out)
    for cmd in ("export", "reshard"):
        assert mbr([cmd, f"src={out}", f"dst={tmp_path / 'dst' / cmd}", "progress=off"]) == 2
    assert not (tmp_path / "dst").exists() and not (tmp_path / "escaped.txt").exists()


def test_manifest_file_that_is_a_fifo_or_leads_outside_is_refused(outputs, tmp_path):
    out = copy_of(outputs["torch_dist"], tmp_path)
    (tmp_path / "secret").write_text("the user's own file")
    os.symlink(tmp_path / "secret", out / "tokenizer_link.json")
    _edit_manifest(out, assets=lambda a: [*a, "tokenizer_link.json"])
    with pytest.raises(UserError, match="leads outside") as e:
        Manifest.read(out)
    assert "the user's own file" not in str(e.value)
    (out / "tokenizer_link.json").unlink()
    os.mkfifo(out / "tokenizer_link.json")
    with pytest.raises(UserError, match=r"is a FIFO \(named pipe\), not a regular file"):
        Manifest.read(out)


def test_export_of_a_training_checkpoint_says_how(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "iter_0000002").mkdir(parents=True)
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("2\n")
    with pytest.raises(UserError, match="is a training checkpoint.*export_to=HF_DIR.*adapter=true"):
        Manifest.read(tmp_path / "ck")


def _index(d: Path, weight_map: dict[str, str]) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _keys(hf: Path) -> list[str]:
    return list(scan_dir(hf))


def test_index_naming_a_file_outside_is_refused_without_reading_it(hf, tmp_path):
    d = copy_of(hf, tmp_path)
    keys = _keys(d)
    (d / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")  # a valid file, outside
    for target, match in (
        ("/etc/passwd", "an absolute path"),
        ("../elsewhere.safetensors", "an absolute path or one with '..'"),
    ):
        _index(d, {k: target for k in keys})
        with pytest.raises(UserError, match=match) as e:
            scan_dir(d)
        assert "root:" not in str(e.value)  # the target's bytes are never echoed
    os.symlink(tmp_path / "elsewhere.safetensors", d / "model-00001-of-00001.safetensors")
    _index(d, {k: "model-00001-of-00001.safetensors" for k in keys})
    with pytest.raises(UserError, match="which leads outside"):
        scan_dir(d)


def test_hub_cache_links_into_blobs_are_admitted(hf, tmp_path):
    """A Hugging Face hub snapshot links its files into the repository's `blobs/`."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in hf.iterdir():
        shutil.copy(f, blobs / f"sha-{f.name}")
        os.symlink(f"../../blobs/sha-{f.name}", snap / f.name)
    assert list(scan_dir(snap)) == _keys(hf)
    assert confined(snap, "config.json", source="test") == snap / "config.json"


def _times_out(fn, seconds: float = 20.0):
    """Run `fn` in a thread; return its exception, or fail if it is still blocked after `seconds`."""
    box: list[BaseException | None] = [None]

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked: the reader opened the FIFO"
    return box[0]


def test_fifo_or_directory_named_model_safetensors_is_refused(hf, tmp_path, monkeypatch):
    """Today's hang: a FIFO named model.safetensors blocked convert and training forever."""
    monkeypatch.chdir(tmp_path)
    d = copy_of(hf, tmp_path)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    e = _times_out(lambda: scan_dir(d))
    assert isinstance(e, UserError) and "is a FIFO (named pipe), not a regular file" in str(e)
    e = _times_out(lambda: mbr(["convert", f"src={d}", f"dst={tmp_path / 'cv'}", "progress=off"]) == 2 or None)
    assert e is None and not (tmp_path / "cv").exists()
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()
    with pytest.raises(UserError, match="is a directory, not a regular file"):
        scan_dir(d)


def test_convert_refuses_an_asset_linking_outside(hf, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    d = copy_of(hf, tmp_path)
    (tmp_path / "id_rsa").write_text("PRIVATE")
    os.symlink(tmp_path / "id_rsa", d / "notes.txt")
    assert mbr(["convert", f"src={d}", f"dst={tmp_path / 'cv'}", "progress=off"]) == 2
    assert not (tmp_path / "cv").exists()


def test_dcp_chunk_path_outside_is_refused(outputs, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    out = copy_of(outputs["torch_dist"], tmp_path)
    md_file = out / "release" / ".metadata"
    md = pickle.loads(md_file.read_bytes())  # our own file: trusted
    index = next(iter(md.storage_data))
    info = md.storage_data[index]
    md.storage_data[index] = _StorageInfo("../../../../etc/passwd", info.offset, info.length)
    md_file.write_bytes(pickle.dumps(md))
    with pytest.raises(UserError, match="names chunk file '../../../../etc/passwd'"):
        DistReader(out / "release", PositionedReader())
