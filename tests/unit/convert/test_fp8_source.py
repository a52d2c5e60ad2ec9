"""FP8 block-quantised sources (DeepSeek-V3 / Kimi-K2 style): read as their bf16 dequantisation.

The oracle is the definition `bf16(fp32(w) * scale_inv[i // 128, j // 128])` — what
transformers' `Fp8Dequantize` computes (checked bit for bit on a model whose dimensions are
multiples of 128) and what DeepSeek's `weight_dequant` computes for partial edge blocks
(hidden 160 = 128 + 32, where transformers splits the rows evenly over the scale grid
instead; docs/convert.md). The torch-free byte path, the tensor path and the live loader
must all give exactly that.
"""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.bridge.loader import HFCheckpoint
from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.formats import fp8
from megatron_bridge.convert.sources.readers import open_checkpoint
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.runtime.tiny_fp8 import dequantize_dir, dequantized_reference, quantize_fp8
from tests.unit.convert.test_convert_direct import run_without_torch

PARTIAL = dict(hidden_size=160, intermediate_size=288, num_attention_heads=10, num_key_value_heads=2, head_dim=16)
WHOLE = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_checkpoint(a: Path, b: Path) -> None:
    """Two converted checkpoints hold the same tensors (their sources' files order tensors
    differently, so records come in another order: compared by value, not by file bytes)."""
    ma, mb = (json.loads((d / "mbr_manifest.json").read_text()) for d in (a, b))
    assert ma["tensors"] == mb["tensors"] and ma["layout"] == mb["layout"] and ma["hf_config"] == mb["hf_config"]
    assert (a / "config.json").read_text() == (b / "config.json").read_text()
    files = sorted(str(p.relative_to(a)) for p in a.rglob("*.pt"))
    assert files == sorted(str(p.relative_to(b)) for p in b.rglob("*.pt"))
    import argparse

    for rel in files:
        with torch.serialization.safe_globals([argparse.Namespace]):
            da, db = (torch.load(d / rel, weights_only=True) for d in (a, b))
        for ck in (k for k in da if k.startswith("model")):
            assert sorted(da[ck]) == sorted(db[ck]), rel
            for k, v in da[ck].items():
                assert (v is None and db[ck][k] is None) or torch.equal(bits(v), bits(db[ck][k])), (rel, k)
    sa, sb = open_checkpoint(a, None), open_checkpoint(b, None)
    try:
        for row in sa.rows:  # the global tensors (torch_dist too), read back and checked against the CRCs
            for x, y in zip(sa.hf_tensors(row), sb.hf_tensors(row)):
                assert torch.equal(bits(x), bits(y)), row.megatron
    finally:
        sa.close()
        sb.close()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, dims in (("partial", PARTIAL), ("whole", WHOLE)):
        src = make_tiny("llama", base / f"{name}-f32", **dims)
        out[name] = quantize_fp8(src, base / f"{name}-fp8")
        out[f"{name}-ref"] = dequantize_dir(out[name], base / f"{name}-ref")
    return out


def test_bytes_equal_torch_for_every_fp8_value():
    """The pure-Python table dequantisation == torch's fp32 multiply + bf16 cast, bit for bit:
    all 256 fp8 bytes (NaN, subnormals, +-0), scales from tiny to huge, partial blocks."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 300, 290
    w = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g)
    s = torch.rand(3, 3, generator=g) * 10.0 ** torch.randint(-8, 4, (3, 3), generator=g).float()
    s[0, 0], s[1, 1], s[2, 2] = 1e-38, 3e36, 1.0
    full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    want = (w.view(torch.float8_e4m3fn).float() * full).to(torch.bfloat16).view(torch.int16)
    assert torch.equal(fp8.dequant_torch(w.view(torch.float8_e4m3fn), s, (128, 128)).view(torch.int16), want)
    scales = array("f")
    scales.frombytes(s.numpy().tobytes())
    got = fp8.dequant_rows(w.numpy().tobytes(), cols, scales, 0, (128, 128))
    assert bytes(got) == want.numpy().tobytes()
    # rows starting at a later block row use that block row's scales
    got = fp8.dequant_rows(w[128:].numpy().tobytes(), cols, scales, 1, (128, 128))
    assert bytes(got) == want[128:].numpy().tobytes()
    got = fp8.dequant_numpy(w.numpy().tobytes(), cols, scales, 0, (128, 128))
    assert got.tobytes() == want.numpy().tobytes()


@pytest.mark.parametrize("shape", [(300, 290), (128, 128), (1, 7), (257, 129), (3, 0), (0, 5)])
def test_numpy_equals_pure_python(shape):
    """The vectorised dequantisation (what convert runs) == the pure-Python tables, bit for bit:
    random bytes (both NaN codes, +-0, subnormals), scales incl. 0, -1, inf, NaN, subnormal and
    overflowing ones, partial blocks, a start at a later block row, 64 x 32 blocks."""
    g = torch.Generator().manual_seed(1)
    for block in ((128, 128), (64, 32)):
        rows, cols = shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        w = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).numpy().tobytes()
        s = torch.rand(grid, generator=g) * 10.0 ** torch.randint(-40, 38, grid, generator=g).float()
        special = [0.0, -1.0, float("inf"), float("nan"), 1e-45, 3e38, -2.5]
        s.view(-1)[: len(special)] = torch.tensor(special)[: s.numel()]
        scales = array("f")
        scales.frombytes(s.numpy().tobytes())
        want = bytes(fp8.dequant_rows(w, cols, scales, 0, block))
        assert fp8.dequant_numpy(w, cols, scales, 0, block).tobytes() == want
        if rows > block[0]:
            later = bytes(fp8.dequant_rows(w[block[0] * cols :], cols, scales, 1, block))
            assert later == want[2 * block[0] * cols :]
            assert fp8.dequant_numpy(w[block[0] * cols :], cols, scales, 1, block).tobytes() == later


def test_equals_transformers_dequantisation(dirs, tmp_path):
    """Dimensions that are multiples of 128: the loader's tensors and `mbr convert`'s output
    equal transformers' own dequantised model (loaded with FineGrainedFP8Config(dequantize=True))."""
    hf = dequantized_reference(dirs["whole"], tmp_path / "transformers")
    want = load_file(hf / "model.safetensors")
    with HFCheckpoint(dirs["whole"]) as ck:
        assert sorted(ck.keys()) == sorted(want)
        for k, t in want.items():
            assert torch.equal(
                ck.tensor(k).view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype),
                t.view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype),
            ), k
    args = ["format=torch", "parallel.tp=2", "progress=off"]
    assert mbr(["convert", f"src={dirs['whole']}", f"dst={tmp_path / 'a'}", *args]) == 0
    assert mbr(["convert", f"src={hf}", f"dst={tmp_path / 'b'}", *args]) == 0
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b")


@pytest.mark.parametrize(
    "args",
    [
        ["format=torch", "parallel.tp=2", "parallel.pp=2"],
        ["format=torch_dist"],
        ["format=torch", "parallel.tp=2", "workers=3"],  # rows dequantised on 3 workers, out of order
        ["format=torch_dist", "workers=1"],
    ],
)
@pytest.mark.parametrize("direct_on", [True, False], ids=["bytes", "tensors"])
def test_convert_partial_blocks(dirs, tmp_path, monkeypatch, args, direct_on):
    """Byte path and tensor path: the fp8 checkpoint converts to exactly what its dequantised
    bf16 checkpoint converts to (whatever `workers=`); scales are consumed; config.json loses
    quantization_config."""
    from megatron_bridge.convert.bytemove import direct

    monkeypatch.setattr(direct, "ENABLED", direct_on)
    assert mbr(["convert", f"src={dirs['partial']}", f"dst={tmp_path / 'a'}", "progress=off", *args]) == 0
    monkeypatch.setattr(direct, "ENABLED", True)
    assert mbr(["convert", f"src={dirs['partial-ref']}", f"dst={tmp_path / 'b'}", "progress=off", *args]) == 0
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b")
    man = json.loads((tmp_path / "a" / "mbr_manifest.json").read_text())
    assert not any(k.endswith("_scale_inv") for k in man["tensors"])
    assert "quantization_config" not in json.loads((tmp_path / "a" / "config.json").read_text())


def test_convert_and_export_without_torch(dirs, tmp_path):
    """The torch-free guarantee holds for fp8 sources; the export is the dequantised checkpoint."""
    run_without_torch(["convert", f"src={dirs['partial']}", f"dst={tmp_path / 'c'}", "format=torch", "parallel.tp=2"])
    run_without_torch(["export", f"src={tmp_path / 'c'}", f"dst={tmp_path / 'hf'}"])
    got, want = (
        load_file(tmp_path / "hf" / "model-00001-of-00001.safetensors"),
        load_file(dirs["partial-ref"] / "model.safetensors"),
    )
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_loader_slices(dirs):
    """Rank-local reads: row/column ranges not aligned to blocks equal the reference's."""
    want = load_file(dirs["partial-ref"] / "model.safetensors")
    with HFCheckpoint(dirs["partial"]) as ck:
        assert not any(k.endswith("_scale_inv") for k in ck.keys())
        for k in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
            s = ck.slice(k)
            assert s.dtype == torch.bfloat16 and tuple(s.shape) == tuple(want[k].shape)
            for a, b, c, d in ((0, 160, 0, 160), (100, 150, 20, 140), (129, 160, 0, 5), (7, 8, 150, 160)):
                assert torch.equal(s[a:b, c:d].view(torch.int16), want[k][a:b, c:d].view(torch.int16)), (k, a, b, c, d)
            assert torch.equal(s[130:140].view(torch.int16), want[k][130:140].view(torch.int16))


def test_inconsistent_checkpoints_are_refused(dirs, tmp_path):
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(dirs["partial"], bad)
    t = load_file(bad / "model.safetensors")
    del t["model.layers.0.mlp.up_proj.weight_scale_inv"]
    save_file(t, bad / "model.safetensors")
    with pytest.raises(UserError, match="up_proj.weight is fp8 without"):
        HFCheckpoint(bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert mbr(["convert", f"src={bad}", f"dst={tmp_path / 'o'}", "progress=off"]) == 2


def test_verify_fp8_source(dirs, capsys, tmp_path):
    """`mbr verify` of an fp8 checkpoint: the bridge's logits equal those of transformers'
    dequantised bf16 model exactly (same weights, same fp32 math), and the round trip gives
    the dequantised tensors back."""
    args = [f"model.hf_path={dirs['whole']}", f"verify.out={tmp_path}", "verify.layouts=[tp1]"]
    assert mbr(["verify", *args, "verify.checks=[logits,roundtrip]"]) == 0
    out = capsys.readouterr().out
    assert "logits      max-abs 0.000e+00" in out and "bit-exact  OK" in out, out


def test_convert_moe(tmp_path):
    """Experts stored per expert in fp8 (router kept as saved): sharded over EP and TP, the
    conversion equals that of the dequantised checkpoint (tiny dims: every block is partial)."""
    src = make_tiny("mixtral", tmp_path / "f32")
    q = quantize_fp8(src, tmp_path / "fp8")
    assert any(".experts.1.w2.weight_scale_inv" in k for k in load_file(q / "model.safetensors"))
    ref = dequantize_dir(q, tmp_path / "ref")
    args = ["format=torch", "parallel.ep=2", "parallel.tp=2", "progress=off"]
    assert mbr(["convert", f"src={q}", f"dst={tmp_path / 'a'}", *args]) == 0
    assert mbr(["convert", f"src={ref}", f"dst={tmp_path / 'b'}", *args]) == 0
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b")


def test_dequantize_in_steps(dirs):
    """The byte path reads a tensor in groups of block rows: every grouping gives the same bytes."""
    from megatron_bridge.convert.formats.safetensors_io import OpenFiles, scan_dir

    want = load_file(dirs["partial-ref"] / "model.safetensors")
    quant = fp8.pair(scan_dir(dirs["partial"]), (128, 128), "test")
    files = OpenFiles()
    try:
        for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
            for step in (0, 128, 256):
                got = fp8.dequantize(quant[name], files, rows_per_read=step)
                assert bytes(got) == bits(want[name]).numpy().tobytes(), (name, step)
    finally:
        files.close()
