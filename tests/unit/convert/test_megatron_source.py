"""Checkpoints Megatron-LM, NeMo and Megatron-Bridge wrote, read as sources (convert/sources/megatron*.py).

The checkpoints are megatron-core's own: `dist_checkpointing.save` of the native GPTModel, under
the local spec's and the Transformer Engine spec's names, and Megatron-LM's per-rank files with
args, optimizer and RNG state (tests/megatron_ckpts.py). Exports are compared bit for bit with
the HF model the weights came from, and once with megatron-core's forward of the checkpoint as
its own `dist_checkpointing.load` reads it; `train.init_from` of each loads the same parameters
as the HF directory.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.sources.megatron import find_megatron
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.tiny import make_tiny
from tests import megatron_ckpts as mc

# dense; dense with tied embeddings and qkv bias; MoE with a dense layer (grouped-GEMM names under
# TE); MoE with shared experts
FAMILIES = ("llama", "qwen2", "qwen3_moe", "qwen2_moe")
KINDS = ("dist", "dist_te", "dist_pre014", "torch", "torch_te")


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlm")
    out: dict[str, Path] = {}
    dists = []
    for fam in (*FAMILIES, "qwen3"):
        hf = out[fam] = make_tiny(fam, root / fam)
        for kind, opts in (("dist", {}), ("dist_te", {"te_names": True}), ("dist_pre014", {"pre_014": True})):
            out[f"{fam}:{kind}"] = root / f"{fam}-{kind}"
            dists.append((hf, root / f"{fam}-{kind}", opts))
        if fam in FAMILIES:
            out[f"{fam}:torch"] = mc.write_torch(hf, root / f"{fam}-torch", te_names=False)
            out[f"{fam}:torch_te"] = mc.write_torch(hf, root / f"{fam}-torch_te")
    mc.write_dists(dists)
    return out


def _refused(capsys, argv: list[str], needle: str) -> None:
    """`mbr argv` exits 2 with one `error:` whose text matches `needle`."""
    capsys.readouterr()
    assert mbr(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and re.search(needle, err), err


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_export_gives_the_hf_tensors_back_bit_for_bit(made, family, tmp_path):
    hf = made[family]
    want = _tensors(hf)
    for kind in KINDS:
        ck = made[f"{family}:{kind}"]
        for src in (ck, ck / "iter_0000010"):  # the tracker directory, or the iteration itself
            dst = tmp_path / f"{kind}-{src.name}"
            assert (
                mbr(["export", f"src={src}", f"dst={dst}", f"model.hf_path={hf / 'config.json'}", "progress=off"]) == 0
            )
            got = _tensors(dst)
            assert sorted(got) == sorted(want), kind
            assert all(torch.equal(got[n], want[n]) for n in want), kind
            assert (dst / "generation_config.json").is_file()  # the files beside config.json


# MoE under local-spec names (TE's MoE layers name their norm otherwise, which the local spec's model
# does not load); dense under TE names (the same keys in torch_dist); the pre-0.14 format
@pytest.mark.parametrize("case", ["qwen3_moe:dist", "llama:dist_te", "qwen2:dist_pre014"])
def test_export_logits_equal_megatron_cores_forward_of_the_checkpoint(made, case, tmp_path):
    from transformers import AutoModelForCausalLM

    family = case.split(":")[0]
    hf, ck = made[family], made[case]
    assert mbr(["export", f"src={ck}", f"dst={tmp_path / 'ex'}", f"model.hf_path={hf}", "progress=off"]) == 0
    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    theirs = mc.mcore_checkpoint_logits(hf, ck / "iter_0000010", ids)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ex", dtype=torch.float32).eval()
    with torch.no_grad():
        ours = model(ids).logits
    assert float((ours - theirs).abs().max()) <= 1e-5


@pytest.mark.parametrize("kind", ["dist_te", "torch_te"])
def test_init_from_loads_what_the_hf_directory_loads(made, kind, groups1):
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import load_hf_weights
    from megatron_bridge.train.init import load_initial_weights

    hf = made["qwen3_moe"]
    spec = describe_hf(read_hf_config(hf), make_vocab_size_divisible_by=64)  # the run pads otherwise
    ours = build_model(spec, Layout(), load_weights=True)
    load_initial_weights(ours, spec, str(made[f"qwen3_moe:{kind}"]))
    ref = build_model(spec, Layout(), load_weights=True)
    load_hf_weights(ref, spec, hf)
    a, b = ours[0].state_dict(), ref[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b if torch.is_tensor(b[k]))


def test_reshard_writes_a_converted_checkpoint_of_another_layout(made, tmp_path):
    hf, ck = made["llama"], made["llama:torch_te"]
    assert (
        mbr(
            [
                "reshard",
                f"src={ck}",
                f"dst={tmp_path / 'r'}",
                f"model.hf_path={hf}",
                "parallel.tp=1",
                "parallel.pp=2",
                "progress=off",
            ]
        )
        == 0
    )
    man = json.loads((tmp_path / "r" / "mbr_manifest.json").read_text())
    assert man["layout"]["pp"] == 2 and man["created_by"] == "mbr reshard"
    assert mbr(["export", f"src={tmp_path / 'r'}", f"dst={tmp_path / 'ex'}", "progress=off"]) == 0
    want, got = _tensors(hf), _tensors(tmp_path / "ex")
    assert all(torch.equal(got[n], want[n]) for n in want)


def _edited_config(hf: Path, d: Path, **fields) -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**json.loads((hf / "config.json").read_text()), **fields}))
    return d


@pytest.mark.parametrize("kind", ["dist", "torch_te"])
def test_another_model_is_refused_naming_both_values(made, kind, tmp_path, capsys):
    hf, ck = made["qwen3_moe"], made[f"qwen3_moe:{kind}"]
    cases = {
        "layers": ({"num_hidden_layers": 5}, "num_layers: model.hf_path="),
        "vocab": ({"vocab_size": 400}, "fewer than the vocabulary of 400"),
        "experts": ({"num_local_experts": 8}, "experts:"),
        "rope": ({"rope_theta": 5.0}, "rotary base:"),
    }
    for name, (fields, needle) in cases.items():
        other = _edited_config(hf, tmp_path / name, **fields)
        _refused(capsys, ["export", f"src={ck}", f"dst={tmp_path / 'x'}", f"model.hf_path={other}"], needle)
        assert not (tmp_path / "x").exists()
    if kind == "dist":  # written at tp1 with divisor 128: 256 rows are not 120 padded
        other = _edited_config(hf, tmp_path / "padding", vocab_size=120)
        argv = ["export", f"src={ck}", f"dst={tmp_path / 'x'}", f"model.hf_path={other}"]
        _refused(capsys, argv, "vocab padding: model.hf_path=.* pads to 128 rows; the checkpoint's embedding has 256")


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])  # qk-norm; qkv bias
def test_without_hf_path_a_dense_model_is_described_by_its_args(made, family, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    hf, ck = made[family], made[f"{family}:dist"]
    capsys.readouterr()
    assert mbr(["export", f"src={ck}", f"dst={tmp_path / 'ex'}", "progress=off"]) == 0
    assert "is described as the" in capsys.readouterr().out
    config = json.loads((tmp_path / "ex" / "config.json").read_text())
    want, got = _tensors(hf), _tensors(tmp_path / "ex")
    assert config["architectures"] == json.loads((hf / "config.json").read_text())["architectures"]
    assert sorted(got) == sorted(want)
    vocab = want["model.embed_tokens.weight"].shape[0]
    for n in want:  # the embedding keeps its padding rows (the run recorded no --vocab-size)
        assert torch.equal(got[n][:vocab] if got[n].shape != want[n].shape else got[n], want[n]), n
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(ids).logits
        ours = AutoModelForCausalLM.from_pretrained(tmp_path / "ex", dtype=torch.float32).eval()(ids).logits
    assert float((ours[..., :vocab] - ref).abs().max()) <= 1e-5


def test_without_hf_path_a_moe_model_is_refused_naming_the_option(made, tmp_path, capsys):
    argv = ["export", f"src={made['qwen3_moe:dist']}", f"dst={tmp_path / 'x'}"]
    _refused(capsys, argv, "it is a MoE model .*Set model.hf_path=DIR")


def test_a_payload_in_a_rank_file_is_refused_and_never_run(made, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    ck = mc.write_torch(made["llama"], tmp_path / "ck", payload=marker)
    for argv in (
        ["export", f"src={ck}", f"dst={tmp_path / 'x'}", f"model.hf_path={made['llama']}"],
        ["verify", f"verify.checkpoint={ck}", f"model.hf_path={made['llama']}", f"verify.out={tmp_path / 'v'}"],
    ):
        _refused(capsys, argv, "was refused: it holds a `posix.system` object")
    assert not marker.exists() and not (tmp_path / "x").exists()


def _nemo(dist: Path, out: Path, model_fields: dict) -> Path:
    """A NeMo 2 checkpoint of the same weights: `weights/` with every key under `module.`,
    `context/model.yaml` with the model's config."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(dist / "iter_0000010", out / "weights")
    md = FileSystemReader(str(out / "weights")).read_metadata()
    md.state_dict_metadata = {f"module.{k}": v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {dataclasses.replace(i, fqn=f"module.{i.fqn}"): v for i, v in md.storage_data.items()}
    (out / "weights" / ".metadata").write_bytes(pickle.dumps(md))
    (out / "weights" / "common.pt").unlink()  # NeMo keeps its config in context/, not args
    (out / "context").mkdir()
    import yaml

    (out / "context" / "model.yaml").write_text(
        yaml.safe_dump({"_target_": "nemo.collections.llm.gpt.model.qwen3.Qwen3Model", "config": model_fields})
    )
    return out


def test_nemo_and_megatron_bridge_layouts(made, tmp_path, capsys):
    import yaml

    hf, dist = made["qwen3_moe"], made["qwen3_moe:dist"]
    fields = {"num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2, "kv_channels": 16}
    fields["num_moe_experts"] = 4
    nemo = _nemo(dist, tmp_path / "model_name--step=10-last", fields)
    md = find_megatron(nemo)
    assert md is not None and (md.writer, md.prefix, md.iteration) == ("NeMo", "module.", 10)
    assert mbr(["export", f'src="{nemo}"', f"dst={tmp_path / 'ex'}", f"model.hf_path={hf}", "progress=off"]) == 0
    want, got = _tensors(hf), _tensors(tmp_path / "ex")
    assert all(torch.equal(got[n], want[n]) for n in want)
    bad = _nemo(dist, tmp_path / "bad", {**fields, "num_moe_experts": 8})
    _refused(
        capsys,
        ["export", f"src={bad}", f"dst={tmp_path / 'x'}", f"model.hf_path={hf}"],
        "experts: model.hf_path=.* says 4, the checkpoint 8",
    )

    mb = Path(shutil.copytree(dist, tmp_path / "mb"))
    (mb / "iter_0000010" / "run_config.yaml").write_text(yaml.safe_dump({"model": {**fields, "num_layers": 3}}))
    assert find_megatron(mb).writer == "Megatron-Bridge"
    _refused(
        capsys,
        ["export", f"src={mb}", f"dst={tmp_path / 'x'}", f"model.hf_path={hf}"],
        "num_layers: model.hf_path=.* says 4, the checkpoint 3",
    )


def test_tracker_and_iteration_directories(made, tmp_path):
    ck = Path(shutil.copytree(made["llama:dist"], tmp_path / "ck"))
    md = find_megatron(ck)
    assert md is not None and md.data == ck / "iter_0000010" and md.format == "torch_dist"
    assert find_megatron(made["llama:torch"]).format == "torch"
    (ck / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(UserError, match="names iter_0000020, which .* does not hold"):
        find_megatron(ck)
    (ck / "latest_checkpointed_iteration.txt").write_text("latest\n")
    with pytest.raises(UserError, match="Megatron writes an iteration number or `release` there"):
        find_megatron(ck)
    assert find_megatron(tmp_path) is None  # not a checkpoint at all


@pytest.mark.parametrize(
    "family,layout",
    [
        ("llama", ["parallel.pp=2", "parallel.vpp=2"]),
        ("qwen3_moe", ["parallel.ep=2"]),
        ("qwen3_moe", ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2"]),
    ],
)
def test_per_rank_files_of_any_layout_the_args_record(made, family, layout, tmp_path):
    """Per-rank files named as Megatron-LM's `get_checkpoint_name` names them (`mp_rank_TT_EEE` at
    pp1: the second number is the EP rank), `model0`/`model1` chunks: which rank holds what
    comes from the args' parallel sizes (our conversion without its manifest is such a checkpoint)."""
    hf = made[family]
    ck = tmp_path / "ck"
    assert mbr(["convert", f"src={hf}", f"dst={ck}", "format=torch", "progress=off", *layout]) == 0
    for f in ("mbr_manifest.json", "config.json"):
        (ck / f).unlink()
    assert mbr(["export", f"src={ck}", f"dst={tmp_path / 'ex'}", f"model.hf_path={hf}", "progress=off"]) == 0
    want, got = _tensors(hf), _tensors(tmp_path / "ex")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def _with_key(dist: Path, out: Path, key: str) -> Path:
    """A copy of torch_dist checkpoint `dist` whose metadata names one more tensor, `key`."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(dist, out)
    d = out / "iter_0000010"
    md = FileSystemReader(str(d)).read_metadata()
    md.state_dict_metadata[key] = md.state_dict_metadata["decoder.final_layernorm.weight"]
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return out


def test_mtp_layers_are_skipped_with_a_note_and_other_tensors_refused(made, tmp_path, capsys):
    hf = made["llama"]
    mtp = _with_key(made["llama:dist"], tmp_path / "mtp", "mtp.layers.0.enorm.weight")
    capsys.readouterr()
    assert mbr(["export", f"src={mtp}", f"dst={tmp_path / 'ex'}", f"model.hf_path={hf}", "progress=off"]) == 0
    assert "skipping 1 tensor(s) of its multi-token-prediction layers" in capsys.readouterr().out
    want, got = _tensors(hf), _tensors(tmp_path / "ex")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    extra = _with_key(made["llama:dist"], tmp_path / "extra", "decoder.layers.self_attention.linear_qkv.bias")
    argv = ["export", f"src={extra}", f"dst={tmp_path / 'x'}", f"model.hf_path={hf}"]
    _refused(capsys, argv, "holds 1 tensor\\(s\\) the model .* has no place for, e.g. decoder.layers.self_attention")


def test_extra_state_stored_as_tensors_is_skipped(made, tmp_path):
    """Transformer Engine 2 keeps a module's `_extra_state` as a uint8 tensor, not a BytesIO."""
    hf = made["llama"]
    ck = Path(shutil.copytree(made["llama:torch_te"], tmp_path / "ck"))
    for f in ck.rglob("model_optim_rng.pt"):
        state = torch.load(f, weights_only=False)  # our own fixture
        model = state["model"]
        for k in [k for k in model if k.endswith("_extra_state")]:
            model[k] = torch.arange(7, dtype=torch.uint8)
        torch.save(state, f)
    assert mbr(["export", f"src={ck}", f"dst={tmp_path / 'ex'}", f"model.hf_path={hf}", "progress=off"]) == 0
    want, got = _tensors(hf), _tensors(tmp_path / "ex")
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
