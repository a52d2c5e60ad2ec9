"""`mbr convert` / `export` / `reshard` round trips on tiny models, in-process (no torchrun).

Exactness is bitwise: HF -> convert (either format, several layouts) -> export gives back
every tensor with the same dtype and bytes; reshard A -> B -> A gives back identical rank
files; a bf16 conversion equals the source cast to bf16; the exported directory loads in
transformers and computes the source's logits. Megatron's on-disk conventions (release
tracker, mp_rank_TT_PPP_EEE names, model0/model1 per virtual stage, args) are checked here;
that megatron-core actually loads them at tp2·pp2 / ep2·pp2 is tests/dist/test_convert_dist.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.cli import main as mbr

# every family with HF weights, each with all of its features on (GPT-OSS's stacked,
# transposed, interleaved experts included: the byte mover gathers those in memory)
FAMILIES = list(TINY)


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    bad = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not bad, bad[:5]


def run(*args: str) -> None:
    assert mbr([*args, "progress=off"]) == 0


def rank_files(d: Path) -> dict[str, dict]:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return {str(p.relative_to(d)): torch.load(p, weights_only=True) for p in sorted(d.rglob("*.pt"))}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from megatron_bridge.runtime.tiny import make_tiny

    base = tmp_path_factory.mktemp("hf")
    out = {f: make_tiny(f, base / f) for f in FAMILIES}
    (out["llama"] / "tokenizer_config.json").write_text('{"model_max_length": 128}\n')
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_dist_round_trip_is_bit_exact(tiny, tmp_path, family):
    src = tiny[family]
    run("convert", f"src={src}", f"dst={tmp_path / 'ckpt'}")
    run("export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / 'hf'}", "max_shard_gb=0.00005")
    assert_same(hf_tensors(src), hf_tensors(tmp_path / "hf"))
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded, and the index names every file
    assert {p.name for p in (tmp_path / "hf").glob("*.safetensors")} == set(index["weight_map"].values())
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert json.loads((ckpt / "release" / "metadata.json").read_text())["sharded_backend"] == "torch_dist"


@pytest.mark.parametrize(
    "family,layout",
    [
        ("llama", ["parallel.tp=2", "parallel.pp=2"]),
        ("llama", ["parallel.pp=2", "parallel.vpp=2"]),
        ("qwen2", ["parallel.tp=2", "parallel.pp=2"]),  # tied embeddings: the last stage holds an output copy
        ("mixtral", ["parallel.ep=2", "parallel.tp=2"]),
        ("qwen2_moe", ["parallel.ep=2", "parallel.pp=2"]),
        ("gpt_oss", ["parallel.ep=2", "parallel.pp=2"]),  # stacked experts split by EP
    ],
)
def test_per_rank_round_trip_is_bit_exact(tiny, tmp_path, family, layout):
    src = tiny[family]
    run("convert", f"src={src}", f"dst={tmp_path / 'ckpt'}", "format=torch", *layout)
    run("export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / 'hf'}")
    assert_same(hf_tensors(src), hf_tensors(tmp_path / "hf"))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_per_rank_tp2_round_trip(tiny, tmp_path, family):
    """format=torch at tp2 (and ep2 for MoE): every family's transforms split and merge its
    tensors bit-exactly in the torch-free converter."""
    from megatron_bridge.bridge.hf_config import load_spec

    spec = load_spec(tiny[family])
    # biased experts need etp=1, and format=torch stores experts by tp rank (etp = tp): tp1
    layout = ([] if spec.is_moe and spec.mlp_bias else ["parallel.tp=2"]) + (["parallel.ep=2"] if spec.is_moe else [])
    run("convert", f"src={tiny[family]}", f"dst={tmp_path / 'ckpt'}", "format=torch", *layout)
    run("export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / 'hf'}")
    assert_same(hf_tensors(tiny[family]), hf_tensors(tmp_path / "hf"))


def test_stacked_experts_torch_dist_at_tp2_ep2_etp1(tiny, tmp_path):
    """GPT-OSS's layout (biased experts: etp=1) converts and exports back bit-exactly."""
    src = tiny["gpt_oss"]
    layout = ["parallel.tp=2", "parallel.ep=2", "parallel.etp=1"]
    run("convert", f"src={src}", f"dst={tmp_path / 'ckpt'}", *layout)
    run("export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / 'hf'}")
    assert_same(hf_tensors(src), hf_tensors(tmp_path / "hf"))


def test_stacked_experts_reshard_round_trip(tiny, tmp_path):
    """Reshard (tensor path) puts each stacked tensor together from its experts' records."""
    src = tiny["gpt_oss"]
    run("convert", f"src={src}", f"dst={tmp_path / 'a'}", "format=torch", "parallel.ep=2", "parallel.pp=2")
    layout_b = ["format=torch_dist", "parallel.tp=2", "parallel.ep=4", "parallel.etp=1"]
    run("reshard", f"src={tmp_path / 'a'}", f"dst={tmp_path / 'b'}", *layout_b)
    run("reshard", f"src={tmp_path / 'b'}", f"dst={tmp_path / 'a2'}", "format=torch", "parallel.ep=2", "parallel.pp=2")
    a, a2 = rank_files(tmp_path / "a"), rank_files(tmp_path / "a2")
    assert a.keys() == a2.keys()
    for f in a:
        x, y = a[f]["model"], a2[f]["model"]
        assert list(x) == list(y), f
        assert all((x[n] is None and y[n] is None) or torch.equal(x[n], y[n]) for n in x), f
    run("export", f"src={tmp_path / 'b'}", f"dst={tmp_path / 'hf'}")
    assert_same(hf_tensors(src), hf_tensors(tmp_path / "hf"))


def test_megatron_per_rank_conventions(tiny, tmp_path):
    run(
        "convert",
        f"src={tiny['llama']}",
        f"dst={tmp_path / 'a'}",
        "format=torch",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.vpp=2",
    )
    files = rank_files(tmp_path / "a")
    assert sorted(files) == [f"release/mp_rank_0{t}_00{p}/model_optim_rng.pt" for t in (0, 1) for p in (0, 1)]
    assert (tmp_path / "a" / "latest_checkpointed_iteration.txt").read_text() == "release"
    sd = files["release/mp_rank_01_001/model_optim_rng.pt"]
    assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == 0
    assert (sd["args"].tensor_model_parallel_size, sd["args"].pipeline_model_parallel_size) == (2, 2)
    assert set(k for k in sd if k.startswith("model")) == {"model0", "model1"}
    # pp rank 1 holds layers 1 (chunk 0) and 3 (chunk 1), stored under local index 0
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in sd["model0"]
    assert sd["model0"]["decoder.layers.0.self_attention.linear_qkv._extra_state"] is None
    assert "output_layer.weight" in sd["model1"] and "output_layer._extra_state" in sd["model1"]
    assert sd["model1"]["output_layer.weight"].shape == (128, 32)  # padded vocab 256 split over tp2
    assert "embedding.word_embeddings.weight" in files["release/mp_rank_00_000/model_optim_rng.pt"]["model0"]

    run("convert", f"src={tiny['mixtral']}", f"dst={tmp_path / 'm'}", "format=torch", "parallel.ep=2")
    moe = rank_files(tmp_path / "m")
    assert sorted(moe) == ["release/mp_rank_00_000/model_optim_rng.pt", "release/mp_rank_00_001/model_optim_rng.pt"]
    local = [k for k in moe["release/mp_rank_00_001/model_optim_rng.pt"]["model"] if ".local_experts." in k]
    assert {k.split(".local_experts.")[1].split(".")[0] for k in local} == {"0", "1"}  # 2 of 4 experts, renumbered


def test_reshard_a_b_a_is_bit_exact(tiny, tmp_path):
    src = tiny["qwen2_moe"]
    run("convert", f"src={src}", f"dst={tmp_path / 'a'}", "format=torch", "parallel.ep=2", "parallel.pp=2")
    run("reshard", f"src={tmp_path / 'a'}", f"dst={tmp_path / 'b'}", "parallel.tp=2", "parallel.pp=4")
    run("reshard", f"src={tmp_path / 'b'}", f"dst={tmp_path / 'a2'}", "parallel.ep=2", "parallel.pp=2")
    a, a2 = rank_files(tmp_path / "a"), rank_files(tmp_path / "a2")
    assert a.keys() == a2.keys()
    for f in a:
        for k in ("model", "checkpoint_version", "iteration"):
            x, y = a[f][k], a2[f][k]
            if k != "model":
                assert x == y
                continue
            assert list(x) == list(y), f
            for n in x:
                assert (x[n] is None and y[n] is None) or (x[n].dtype == y[n].dtype and torch.equal(x[n], y[n])), (f, n)
    # torch_dist <-> per-rank through reshard: same bytes as converting directly
    run("convert", f"src={src}", f"dst={tmp_path / 'd'}")
    run("reshard", f"src={tmp_path / 'd'}", f"dst={tmp_path / 'a3'}", "parallel.ep=2", "parallel.pp=2")
    a3 = rank_files(tmp_path / "a3")
    assert all(
        torch.equal(a[f]["model"][n], a3[f]["model"][n])
        for f in a
        for n in a[f]["model"]
        if a[f]["model"][n] is not None
    )
    run("reshard", f"src={tmp_path / 'b'}", f"dst={tmp_path / 'd2'}", "format=torch_dist")
    run("export", f"src={tmp_path / 'd2'}", f"dst={tmp_path / 'hf'}")
    assert_same(hf_tensors(src), hf_tensors(tmp_path / "hf"))


def test_bf16_multi_file_source_and_dtype_cast(tiny, tmp_path):
    from safetensors.torch import save_file

    ref = {k: v.to(torch.bfloat16) for k, v in hf_tensors(tiny["llama"]).items()}
    src = tmp_path / "bf16"
    src.mkdir()
    names = sorted(ref)
    weight_map = {}
    for i, part in enumerate((names[:10], names[10:25], names[25:])):  # three files + index
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({k: ref[k] for k in part}, str(src / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "config.json").write_text((tiny["llama"] / "config.json").read_text())
    run("convert", f"src={src}", f"dst={tmp_path / 'ckpt'}", "format=torch", "parallel.tp=2")
    run("export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / 'out'}")
    assert_same(ref, hf_tensors(tmp_path / "out"))

    run("convert", f"src={tiny['llama']}", f"dst={tmp_path / 'cast'}", "dtype=bf16")  # fp32 source -> bf16
    man = json.loads((tmp_path / "cast" / "mbr_manifest.json").read_text())
    assert man["dtype"] == "bfloat16" and {t["dtype"] for t in man["tensors"].values()} == {"BF16"}
    run("export", f"src={tmp_path / 'cast'}", f"dst={tmp_path / 'cast_hf'}")
    assert_same(ref, hf_tensors(tmp_path / "cast_hf"))
    assert json.loads((tmp_path / "cast_hf" / "config.json").read_text())["dtype"] == "bfloat16"
    run("export", f"src={tmp_path / 'cast'}", f"dst={tmp_path / 'back32'}", "dtype=fp32")  # cast on export
    assert all(t.dtype == torch.float32 for t in hf_tensors(tmp_path / "back32").values())


def test_export_loads_in_transformers_with_the_same_logits(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny["llama"]
    run("convert", f"src={src}", f"dst={tmp_path / 'ckpt'}", "format=torch", "parallel.pp=2")
    run("export", f"src={tmp_path / 'ckpt'}", f"dst={tmp_path / 'hf'}")
    assert (tmp_path / "hf" / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    ids = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()(ids).logits
    assert torch.equal(a, b)
    # the index records each weight file's CRC-32 (transformers ignores it; our loads check it)
    from megatron_bridge.convert.formats.manifest import check_index_crc32

    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["metadata"]["file_crc32"]) == set(index["weight_map"].values())
    assert check_index_crc32(tmp_path / "hf") == len(set(index["weight_map"].values()))


def test_summary_line_and_progress_bar(tiny, tmp_path, capsys):
    assert mbr(["convert", f"src={tiny['llama']}", f"dst={tmp_path / 'c'}", "progress=on"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("converted 39 tensors, ") and " GB in " in line and " GB/s) -> " in line
    assert "torch_dist" in line
    man = json.loads((tmp_path / "c" / "mbr_manifest.json").read_text())
    assert man["format"] == "torch_dist" and len(man["tensors"]) == 39
    assert all(len(t["crc32"]) == 8 for t in man["tensors"].values())
    assert set(man["files"]) >= {"release/__0_0.distcp", "release/.metadata", "release/common.pt", "config.json"}
