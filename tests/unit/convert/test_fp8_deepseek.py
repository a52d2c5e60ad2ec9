"""An FP8 DeepSeek-V3 checkpoint as the hub stores it (issue #14): MLA projections, routed and
shared experts, a dense first layer, the correction bias and a multi-token-prediction layer.

The oracle is transformers' own dequantisation (`FineGrainedFP8Config(dequantize=True)`,
saved back). Every weight of the tiny is < 128 in both dimensions, so each is ONE partial
block (`quantize_block_fp8` takes amax over the whole tensor, a 1 x 1 scale grid); there
transformers' even split of rows over the grid and DeepSeek's `weight_dequant` agree, so the
comparison is bit for bit (multi-block partial edges: tests/unit/convert/test_fp8_source.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_bridge.cli import main as mbr
from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.runtime.tiny_fp8 import dequantized_reference, quantize_fp8
from tests.unit.convert.test_fp8_source import assert_same_checkpoint, bits

LAYERS = 4  # TINY's num_hidden_layers: the MTP layer is model.layers.4
MTP = f"model.layers.{LAYERS}."


def add_mtp_layer(ckpt: Path) -> None:
    """Append one MTP layer as DeepSeek-V3 stores it (model.layers.61 on the hub): a full MoE
    decoder layer plus enorm, hnorm, eh_proj, embed_tokens and shared_head.{norm,head}."""
    path = ckpt / "model.safetensors"
    sd = load_file(path)
    g = torch.Generator().manual_seed(1)
    last = f"model.layers.{LAYERS - 1}."
    for k, v in list(sd.items()):
        if k.startswith(last):  # another MoE layer's worth of weights, different values
            sd[MTP + k[len(last) :]] = v + 0.01 * torch.randn(v.shape, generator=g)
    hidden, vocab = sd["model.norm.weight"].shape[0], sd["lm_head.weight"].shape[0]
    for name, shape in (
        ("enorm.weight", (hidden,)),
        ("hnorm.weight", (hidden,)),
        ("eh_proj.weight", (hidden, 2 * hidden)),
        ("embed_tokens.weight", (vocab, hidden)),
        ("shared_head.norm.weight", (hidden,)),
        ("shared_head.head.weight", (vocab, hidden)),
    ):
        sd[MTP + name] = 0.05 * torch.randn(shape, generator=g) + ("norm" in name)
    save_file(sd, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8ds")
    src = make_tiny("deepseek_v3", base / "f32")
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1
    add_mtp_layer(src)
    q = quantize_fp8(src, base / "fp8")
    return {"fp8": q, "ref": dequantized_reference(q, base / "ref")}


def test_quantised_like_the_hub(dirs):
    """Linear weights (MLA q_a/q_b/kv_a/kv_b/o, dense MLP, routed and shared experts, the MTP
    layer's decoder) are fp8 with a 1 x 1 fp32 scale grid; norms, embeddings, lm_head, the
    router, eh_proj and shared_head.head bf16; e_score_correction_bias fp32."""
    sd = load_file(dirs["fp8"] / "model.safetensors")
    fp8 = {k for k, v in sd.items() if v.dtype == torch.float8_e4m3fn}
    assert {k + "_scale_inv" for k in fp8} == {k for k in sd if k.endswith("_scale_inv")}
    assert all(sd[k + "_scale_inv"].shape == (1, 1) and sd[k + "_scale_inv"].dtype == torch.float32 for k in fp8)
    for p in (0, 1, LAYERS):
        for m in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            assert f"model.layers.{p}.self_attn.{m}.weight" in fp8
    for m in ("gate_proj", "up_proj", "down_proj"):
        assert f"model.layers.0.mlp.{m}.weight" in fp8
        for p in (1, LAYERS):
            assert f"model.layers.{p}.mlp.shared_experts.{m}.weight" in fp8
            assert all(f"model.layers.{p}.mlp.experts.{e}.{m}.weight" in fp8 for e in range(8))
    assert len(fp8) == 5 * (LAYERS + 1) + 3 + LAYERS * 3 * 9  # attention, dense MLP, 8 experts + shared
    rest = {k: v.dtype for k, v in sd.items() if k not in fp8 and not k.endswith("_scale_inv")}
    assert {k for k, d in rest.items() if d == torch.float32} == {
        f"model.layers.{p}.mlp.gate.e_score_correction_bias" for p in (1, 2, 3, LAYERS)
    }
    assert all(d == torch.bfloat16 for k, d in rest.items() if "e_score" not in k)
    for k in ("eh_proj", "embed_tokens", "shared_head.head", "enorm", "mlp.gate"):
        assert f"{MTP}{k}.weight" in rest


def test_convert_export_equal_transformers_dequantisation(dirs, tmp_path, capsys):
    """`mbr convert` (torch_dist, and per-rank files at ep2·tp2) of the fp8 checkpoint equals
    the conversion of transformers' dequantised model (which drops the MTP layer), the MTP
    layer is skipped with a note, and `mbr export` gives transformers' tensors back bit for
    bit and says what it did not write."""
    want = load_file(dirs["ref"] / "model.safetensors")
    assert not any(k.startswith(MTP) for k in want) and "lm_head.weight" in want
    mtp = [k for k in load_file(dirs["fp8"] / "model.safetensors") if k.startswith(MTP)]
    n_mtp = sum(not k.endswith("_scale_inv") for k in mtp)  # counted as the loader counts them
    assert 0 < n_mtp < len(mtp)
    for name, args in (("dist", ["format=torch_dist"]), ("ep2tp2", ["format=torch", "parallel.ep=2", "parallel.tp=2"])):
        a, b = tmp_path / f"{name}-fp8", tmp_path / f"{name}-ref"
        capsys.readouterr()
        assert mbr(["convert", f"src={dirs['fp8']}", f"dst={a}", "progress=off", *args]) == 0
        out = capsys.readouterr().out
        assert f"note: skipping {n_mtp} tensor(s) of 1 multi-token-prediction layer(s) (model.layers.4+)" in out, out
        assert mbr(["convert", f"src={dirs['ref']}", f"dst={b}", "progress=off", *args]) == 0
        assert "skipping" not in capsys.readouterr().out  # the reference has no MTP tensors
        assert_same_checkpoint(a, b)
        assert "quantization_config" not in json.loads((a / "config.json").read_text())
        assert mbr(["export", f"src={a}", f"dst={tmp_path / name}-hf", "progress=off"]) == 0
        out = capsys.readouterr().out
        assert "note: export did not write 1 multi-token-prediction layer(s) (model.layers.4+)" in out, out
        got = {}
        for f in sorted((tmp_path / f"{name}-hf").glob("*.safetensors")):
            got.update(load_file(f))
        assert sorted(got) == sorted(want)
        for k, t in want.items():
            assert got[k].dtype == t.dtype and torch.equal(bits(got[k]), bits(t)), k
        assert got["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32


def test_verify_fp8_deepseek(dirs, capsys, tmp_path):
    """`mbr verify` of the fp8 checkpoint at tp1 (in-process): the bridge's logits match
    transformers' dequantised model's (MoE sums in another order: not bit for bit), and the
    round trip gives every tensor back bit for bit but the MTP layer's, which the bridge skips
    (parity.compare_dirs). ep2·tp2 is a 4-process launch: docs/convert.md has its output."""
    args = [f"model.hf_path={dirs['fp8']}", f"verify.out={tmp_path}", "verify.layouts=[tp1]"]
    assert mbr(["verify", *args, "verify.checks=[logits,roundtrip]"]) == 0
    out = capsys.readouterr().out
    n = len(load_file(dirs["ref"] / "model.safetensors"))
    assert f"round trip  {n} tensors bit-exact  OK" in out and "all layouts OK" in out, out


def test_partial_edge_blocks(tmp_path):
    """Dimensions past 128 that are not multiples of it (hidden 160, q_lora 136, kv_a 144
    rows like the hub's 576, experts 144): each edge block uses its own scale, as DeepSeek's
    `weight_dequant` does (transformers splits rows evenly over the grid there, so the
    oracle is the definition, `dequantize_dir`); at ep2·tp2 the conversion equals that of
    the dequantised checkpoint."""
    from megatron_bridge.runtime.tiny_fp8 import dequantize_dir

    dims = dict(hidden_size=160, q_lora_rank=136, kv_lora_rank=136, moe_intermediate_size=144, intermediate_size=288)
    src = make_tiny("deepseek_v3", tmp_path / "f32", **dims)
    add_mtp_layer(src)
    q = quantize_fp8(src, tmp_path / "fp8")
    sd = load_file(q / "model.safetensors")
    assert sd["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (2, 2)
    assert sd["model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv"].shape == (2, 2)
    ref = dequantize_dir(q, tmp_path / "ref")
    args = ["format=torch", "parallel.ep=2", "parallel.tp=2", "progress=off"]
    assert mbr(["convert", f"src={q}", f"dst={tmp_path / 'a'}", *args]) == 0
    assert mbr(["convert", f"src={ref}", f"dst={tmp_path / 'b'}", *args]) == 0
    assert_same_checkpoint(tmp_path / "a", tmp_path / "b")
