"""`mbr convert` / `export` / `reshard` for transformers-backed models, in-process (no torchrun).

Tiny random models of the transformers backend's catalogue (runtime/hf_tiny.py: every distinctive
feature on, constants perturbed), one per kind of tensor its table holds: plain column / row /
vocab splits and per-head norms (Cohere, tied), experts saved one tensor per expert and stacked
in the model (dots.llm1, with a dense first layer), experts stacked in the file too (Granite-MoE),
linear-attention layers beside attention layers (Qwen3-Next), 0-dim tensors (Apertus), a fused
conv saved as pieces (Kimi-Linear), integer buffers (DeepSeek-V4's hash-routing table), an
embedding saved in row pieces and split over TP by its columns (Qwen4-Exp's n-gram table). HF ->
either format at a layout -> export gives back every tensor bit for bit (names, dtypes, shapes);
reshard A -> B -> export the same; A -> torch_dist -> A the same rank files (names, tensors, args). That such
checkpoints load into real chunks at those layouts is tests/dist/test_convert_dist.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_bridge.cli import main as mbr

DENSE = ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]
MOE = ["parallel.ep=2", "parallel.tp=2", "parallel.pp=2"]
# (architecture, a per-rank layout, another one to reshard to)
CASES = [
    ("cohere", DENSE, ["parallel.tp=1", "parallel.pp=4"]),
    ("dots1", MOE, ["parallel.ep=4", "parallel.pp=1"]),
    ("granitemoe", MOE, ["parallel.ep=1", "parallel.tp=1", "parallel.pp=2"]),
    ("qwen3_next", MOE, ["parallel.ep=4", "parallel.tp=1", "parallel.pp=1"]),
    ("apertus", DENSE, ["parallel.tp=1", "parallel.pp=2"]),
    ("kimi_linear", MOE, ["parallel.ep=1", "parallel.tp=2", "parallel.pp=1"]),
    ("deepseek_v4", MOE, ["parallel.ep=4", "parallel.tp=1", "parallel.pp=1"]),
    ("qwen4_exp_text", MOE, ["parallel.ep=1", "parallel.tp=1", "parallel.pp=1"]),
]


def hf_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Every tensor with the same name, dtype, shape and bytes (NaN-safe: the bytes)."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:6]
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (k, x.dtype, y.dtype, x.shape, y.shape)
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), k


def run(*args: str) -> None:
    assert mbr([*args, "progress=off"]) == 0, args


def rank_files(d: Path) -> dict[str, dict]:
    from megatron_bridge.convert.formats.pickle_guard import CONVERTED
    from megatron_bridge.runtime.safe_load import torch_load

    return {str(p.relative_to(d)): torch_load(p, CONVERTED, map_location="cpu") for p in sorted(d.rglob("*.pt"))}


def assert_same_rank_files(a: Path, b: Path) -> None:
    """The same files with the same chunks: names in order, tensors bitwise, the same args
    (a `torch.save` file's bytes also hold a fresh serialization id)."""
    x, y = rank_files(a), rank_files(b)
    assert x.keys() == y.keys()
    for f in x:
        assert x[f].keys() == y[f].keys() and vars(x[f]["args"]) == vars(y[f]["args"]), f
        for chunk in (k for k in x[f] if k.startswith("model")):
            assert list(x[f][chunk]) == list(y[f][chunk]), (f, chunk)
            a, b = x[f][chunk], y[f][chunk]
            assert all(a[n] is b[n] is None or torch.equal(a[n], b[n]) for n in a), (f, chunk)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from megatron_bridge.runtime.hf_tiny import make_tiny

    base = tmp_path_factory.mktemp("hf")
    return {a: make_tiny(a, base / a) for a, _, _ in CASES}


@pytest.mark.parametrize("arch,layout,other", CASES, ids=[c[0] for c in CASES])
def test_convert_export_and_reshard_give_back_every_tensor_bit_for_bit(arch, layout, other, tiny, tmp_path):
    src, t = tiny[arch], tmp_path
    want = hf_tensors(src)
    run("convert", f"src={src}", f"dst={t / 'dist'}")  # torch_dist, written at tp1·pp1
    run("export", f"src={t / 'dist'}", f"dst={t / 'from_dist'}")
    assert_same(want, hf_tensors(t / "from_dist"))
    run("convert", f"src={src}", f"dst={t / 'a'}", "format=torch", *layout)
    run("export", f"src={t / 'a'}", f"dst={t / 'from_a'}")
    assert_same(want, hf_tensors(t / "from_a"))
    run("reshard", f"src={t / 'a'}", f"dst={t / 'b'}", "format=torch", *other)
    run("export", f"src={t / 'b'}", f"dst={t / 'from_b'}")
    assert_same(want, hf_tensors(t / "from_b"))
    run("reshard", f"src={t / 'b'}", f"dst={t / 'b_dist'}", "format=torch_dist")
    run("reshard", f"src={t / 'b_dist'}", f"dst={t / 'a2'}", "format=torch", *layout)
    assert_same_rank_files(t / "a", t / "a2")


def test_the_export_loads_in_transformers_with_the_source_logits(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny["dots1"]
    run("convert", f"src={src}", f"dst={tmp_path / 'ck'}", "format=torch", *MOE)
    run("export", f"src={tmp_path / 'ck'}", f"dst={tmp_path / 'hf'}")
    ids = torch.arange(24).reshape(2, 12) % 200
    logits = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)(ids).logits for d in (src, tmp_path / "hf")]
    assert torch.equal(*logits)


def test_a_rank_file_holds_what_the_chunk_built_for_its_rank_holds(tiny, tmp_path, groups1):
    """At tp1·pp1 (one process): the rank file's tensors are the built chunk's state dict, names
    and shapes, and `train.init_from` of either format loads the HF directory's values."""
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import checkpoint_tensors, load_hf_weights
    from megatron_bridge.train.init import load_initial_weights

    src = tiny["dots1"]
    spec = describe_hf(read_hf_config(src), make_vocab_size_divisible_by=64)
    (want,) = build_model(spec, Layout(), load_weights=True)
    load_hf_weights([want], spec, src)
    expected = checkpoint_tensors(want)
    for fmt in ("torch_dist", "torch"):
        run("convert", f"src={src}", f"dst={tmp_path / fmt}", f"format={fmt}", "model.make_vocab_size_divisible_by=64")
        (chunk,) = build_model(spec, Layout(), load_weights=True)
        load_initial_weights([chunk], spec, str(tmp_path / fmt))
        got = checkpoint_tensors(chunk)
        assert got.keys() == expected.keys(), fmt
        assert all(torch.equal(got[k], expected[k]) for k in got), fmt
    (state,) = rank_files(tmp_path / "torch").values()
    assert state["model"].keys() == want.state_dict().keys()  # megatron's linears' `_extra_state` included
    assert {k: tuple(v.shape) for k, v in state["model"].items() if v is not None} == {
        k: tuple(v.shape) for k, v in expected.items()
    }


def test_a_wrongly_shaped_or_missing_tensor_is_named(tiny, tmp_path, capsys):
    """A tensor of the wrong shape is named with its shape; a missing one by its own name (a
    linear-attention layer is never asked for attention weights)."""
    from safetensors.torch import load_file, save_file

    src = tiny["qwen3_next"]
    tensors = load_file(str(src / "model.safetensors"))
    for case, edit in (
        ("shape", lambda d: d.__setitem__("model.layers.0.linear_attn.out_proj.weight", torch.zeros(3, 3))),
        ("missing", lambda d: d.pop("model.layers.1.mlp.experts.2.up_proj.weight")),
    ):
        bad = tmp_path / case
        bad.mkdir()
        (bad / "config.json").write_text((src / "config.json").read_text())
        t = dict(tensors)
        edit(t)
        save_file(t, str(bad / "model.safetensors"))
        assert mbr(["convert", f"src={bad}", f"dst={tmp_path / f'{case}.ck'}", "progress=off"]) == 2
        err = capsys.readouterr().err
        assert not (tmp_path / f"{case}.ck").exists()
        if case == "shape":
            assert "model.layers.0.linear_attn.out_proj.weight [[3, 3]]" in err, err
        else:
            assert "incomplete" in err and "experts.2.up_proj.weight'], absent" in err and "self_attn" not in err, err


def test_a_checkpoint_holding_the_experts_as_the_model_does_converts_and_loads(tiny, tmp_path, groups1):
    """transformers loads a checkpoint saved either way: experts one tensor each (what
    `save_pretrained` writes) or stacked as the model holds them (`mlp.experts.gate_up_proj`, a
    state dict saved as it is). Both convert and export back as they were, and load the same weights."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import checkpoint_tensors, load_hf_weights

    src = tiny["dots1"]
    held = tmp_path / "held"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    held.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(held / "model.safetensors"))
    model.config.save_pretrained(held)
    assert "model.layers.1.mlp.experts.gate_up_proj" in hf_tensors(held)
    for fmt in (["format=torch_dist"], ["format=torch", *MOE]):
        run("convert", f"src={held}", f"dst={tmp_path / 'ck'}", "overwrite=true", *fmt)
        run("export", f"src={tmp_path / 'ck'}", f"dst={tmp_path / 'out'}", "overwrite=true")
        assert_same(hf_tensors(held), hf_tensors(tmp_path / "out"))
    spec = describe_hf(read_hf_config(src), make_vocab_size_divisible_by=64)
    loaded = []
    for d in (src, held):
        (chunk,) = build_model(spec, Layout(), load_weights=True)
        load_hf_weights([chunk], spec, d)
        loaded.append(checkpoint_tensors(chunk))
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])
