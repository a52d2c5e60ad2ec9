"""Every bad input to the conversion commands: one clear message, exit 2, nothing written.

"Nothing written" means: `dst` does not exist afterwards and no temporary directory is
left next to it (output goes to `.<dst>.partial-*` and is renamed only on success). One
case runs the real `mbr` process to check the exit code and that no traceback is printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_bridge.cli import main as mbr
from megatron_bridge.errors import UserError

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from megatron_bridge.runtime.tiny import make_tiny

    return make_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture
def src(llama, tmp_path) -> Path:
    """A private copy of the tiny model to damage."""
    return Path(shutil.copytree(llama, tmp_path / "src"))


def refused(capsys, *args: str, match: str) -> str:
    """Run the command; it must exit 2 with `match` in its message and leave no output."""
    dst = next((Path(a.split("=", 1)[1]) for a in args if a.startswith("dst=")), None)
    existed = dst is not None and dst.exists()
    code = mbr([*args, "progress=off"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and match in err, err
    if dst is not None:
        assert dst.exists() == existed, f"{dst} was written"
        assert not [p for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.")], "temporary output left"
    return err


def rewrite_config(src: Path, **changes) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (src / "config.json").write_text(json.dumps(cfg))


def weights(src: Path) -> Path:
    return next(src.glob("*.safetensors"))


def test_missing_or_non_hf_source(capsys, tmp_path, src):
    refused(capsys, "convert", f"src={tmp_path / 'nope'}", f"dst={tmp_path / 'o'}", match="does not exist")
    (src / "config.json").unlink()
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="no config.json")
    (src / "config.json").write_text("{not json")
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="not valid JSON")
    refused(capsys, "convert", f"src={src}", match="src=DIR and dst=DIR are required")


def test_unsupported_architecture(capsys, tmp_path, src):
    rewrite_config(src, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    refused(
        capsys,
        "convert",
        f"src={src}",
        f"dst={tmp_path / 'o'}",
        match="GPT2LMHeadModel (model_type 'gpt2') has no native family",
    )


def test_corrupt_and_truncated_safetensors(capsys, tmp_path, src):
    f = weights(src)
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="truncated")
    f.write_bytes(data[:8] + b"{garbage" + data[16:])
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="corrupt safetensors header")
    f.write_bytes(b"\x00\x01")
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="not a safetensors file")


def test_index_naming_missing_file_or_tensor(capsys, tmp_path, src):
    from safetensors.torch import load_file

    names = list(load_file(str(weights(src))))
    index = src / "model.safetensors.index.json"
    index.write_text(
        json.dumps({"weight_map": {n: weights(src).name for n in names} | {"extra.weight": "model-2.safetensors"}})
    )
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="model-2.safetensors")
    index.write_text(
        json.dumps({"weight_map": {n: weights(src).name for n in names} | {"ghost.weight": weights(src).name}})
    )
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="ghost.weight")


def test_shapes_that_disagree_with_config(capsys, tmp_path, src):
    rewrite_config(src, intermediate_size=48)
    err = refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="disagree with config.json")
    assert "mlp.gate_proj.weight" in err and "[96, 32]" in err  # the offending tensors, with the implied shape
    rewrite_config(src, intermediate_size=64, num_key_value_heads=4)
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="k_proj")


def test_missing_and_unexpected_tensors(capsys, tmp_path, src):
    from safetensors.torch import load_file, save_file

    f = weights(src)
    t = load_file(str(f))
    save_file({k: v for k, v in t.items() if k != "model.layers.3.self_attn.o_proj.weight"}, str(f))
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="model.layers.3.self_attn.o_proj.weight")
    save_file(t, str(f))
    rewrite_config(src, num_hidden_layers=3)
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="model.layers.3.")
    rewrite_config(src, num_hidden_layers=4)
    save_file({**t, "model.layers.0.mlp.surprise.weight": torch.zeros(2)}, str(f))
    refused(capsys, "convert", f"src={src}", f"dst={tmp_path / 'o'}", match="surprise")


def test_layouts_that_fail_validation(capsys, tmp_path, llama):
    err = refused(
        capsys,
        "convert",
        f"src={llama}",
        f"dst={tmp_path / 'o'}",
        "format=torch",
        "parallel.tp=3",
        "parallel.pp=3",
        match="heads-tp",
    )
    assert "layers-pp" in err  # every violated rule at once
    refused(capsys, "convert", f"src={llama}", f"dst={tmp_path / 'o'}", "parallel.ep=2", match="ep-dense")
    refused(
        capsys, "convert", f"src={llama}", f"dst={tmp_path / 'o'}", "format=torch", "parallel.vpp=2", match="vpp-pp"
    )
    refused(capsys, "convert", f"src={llama}", f"dst={tmp_path / 'o'}", "format=zip", match="format='zip'")
    refused(capsys, "convert", f"src={llama}", f"dst={tmp_path / 'o'}", "dtype=int8", match="dtype='int8'")


def test_existing_or_overlapping_destination(capsys, tmp_path, llama):
    dst = tmp_path / "o"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    refused(capsys, "convert", f"src={llama}", f"dst={dst}", match="already exists")
    assert (dst / "keep.txt").read_text() == "mine"
    refused(capsys, "convert", f"src={llama}", f"dst={llama / 'inside'}", match="overlap")
    refused(capsys, "convert", f"src={llama}", f"dst={dst}", "overwrite=true", match="not an output of mbr")
    assert (dst / "keep.txt").read_text() == "mine"  # a user's directory: never replaced
    (dst / "keep.txt").unlink()
    (dst / "mbr_manifest.json").write_text("{}")  # an output of ours: replaced
    assert mbr(["convert", f"src={llama}", f"dst={dst}", "overwrite=true", "progress=off"]) == 0
    assert (dst / "config.json").is_file() and (dst / "mbr_manifest.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".o.")]


def test_failure_mid_write_leaves_nothing(monkeypatch, capsys, tmp_path, llama):
    from megatron_bridge.convert.formats import dist_ckpt

    calls = {"n": 0}
    real = dist_ckpt.DistWriter.add

    def flaky(self, *args):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError(28, "No space left on device")
        return real(self, *args)

    monkeypatch.setattr(dist_ckpt.DistWriter, "add", flaky)
    refused(capsys, "convert", f"src={llama}", f"dst={tmp_path / 'o'}", match="No space left on device")
    monkeypatch.setattr(dist_ckpt.DistWriter, "add", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    assert mbr(["convert", f"src={llama}", f"dst={tmp_path / 'o'}", "progress=off"]) == 130  # Ctrl-C
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".o.", "o"))]


def test_damaged_converted_checkpoints(capsys, tmp_path, llama):
    refused(capsys, "export", f"src={llama}", f"dst={tmp_path / 'x'}", match="not an `mbr convert` output")
    ckpt = tmp_path / "t"
    assert mbr(["convert", f"src={llama}", f"dst={ckpt}", "format=torch", "parallel.tp=2", "progress=off"]) == 0
    rank = ckpt / "release" / "mp_rank_01" / "model_optim_rng.pt"
    data = bytearray(rank.read_bytes())
    rank.write_bytes(bytes(data[:-64]))
    refused(capsys, "export", f"src={ckpt}", f"dst={tmp_path / 'x'}", match="truncated or modified")
    from megatron_bridge.convert.formats.safetensors_io import PositionedReader
    from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile

    rank.write_bytes(bytes(data))
    lazy = LazyTorchFile(rank, PositionedReader())
    _, start, _ = lazy.range(lazy.obj["model"]["decoder.layers.2.mlp.linear_fc2.weight"])
    data[start + 5] ^= 0xFF  # same size, one flipped byte inside a tensor
    rank.write_bytes(bytes(data))
    refused(
        capsys, "export", f"src={ckpt}", f"dst={tmp_path / 'x'}", match="down_proj.weight does not match its checksum"
    )
    refused(capsys, "reshard", f"src={ckpt}", f"dst={tmp_path / 'y'}", "parallel.tp=1", match="checksum")


def test_real_process_exit_code_and_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_bridge.cli",
            "convert",
            f"src={tmp_path / 'missing'}",
            f"dst={tmp_path / 'o'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: src=") and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_training_refuses_a_mismatched_or_foreign_checkpoint(tmp_path, llama):
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.runtime.load_converted import load_converted

    assert mbr(["convert", f"src={llama}", f"dst={tmp_path / 'c'}", "progress=off"]) == 0
    other = load_spec(llama).replace(num_layers=2)
    with pytest.raises(UserError, match="holds a different model than the run builds: num_layers=2"):
        load_converted([], other, tmp_path / "c")
    with pytest.raises(UserError, match="not an `mbr convert` output"):
        load_converted([], other, llama)
