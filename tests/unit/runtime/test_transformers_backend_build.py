"""The transformers backend's runtime half in one process (tp1, gloo): transformers' modules under
megatron's layers give transformers' logits, loss and every gradient, the export is bit-exact,
and a stage holds only its pieces. TP and PP run in tests/dist/test_transformers_backend_parity.py."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge.tiny import HF_TINY

FAMILIES = [*HF_TINY, "llama"]  # llama: a native family forced onto the transformers backend
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("hf_models")
    ids, labels = make_batch(250)
    out = {}
    for fam in FAMILIES:
        path = make_tiny(fam, root / fam)
        out[fam] = (path, dict(input_ids=ids, labels=labels, **hf_reference(path, ids, labels)))
    return out


def _spec(path):
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import read_hf_config

    return describe_hf(read_hf_config(path), backend="transformers", make_vocab_size_divisible_by=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_grads_and_round_trip_equal_transformers(family, models, groups1, tmp_path):
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.parity import check_layout

    path, ref = models[family]
    res = check_layout(
        path,
        Layout(),
        ["logits", "grads", "roundtrip"],
        ref=ref,
        input_ids=ref["input_ids"],
        labels=ref["labels"],
        export_dir=tmp_path,
        backend="transformers",
    )
    assert res["logits"]["max_abs"] < TOL, res["logits"]
    assert abs(res["loss"]["value"] - ref["loss"]) < TOL
    assert res["grads"]["n"] == len(ref["grads"]) and not res["grads"]["bad"]
    assert res["grads"]["max_abs"] < TOL, res["grads"]
    assert res["roundtrip"]["ok"] and res["roundtrip"]["n"] == len(ref["grads"]), res["roundtrip"]


def test_a_stage_holds_only_its_pieces_and_nothing_stays_on_the_meta_device(models, groups1):
    from transformers import AutoModelForCausalLM

    from megatron_bridge.backends.transformers.backend import meta, model_plan, transformers_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.transformers.build import Stage, transformer_config
    from megatron_bridge.runtime.weights import checkpoint_tensors

    spec = _spec(models["cohere"][0])
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(transformers_config(spec))
    stage = Stage(
        spec, full, model_plan(full), meta(spec).kinds, transformer_config(spec, Layout()), torch.device("cpu"), True
    )
    last = stage.chunk(range(2, 4), pre=False, post=True)
    names = set(checkpoint_tensors(last))
    assert {n.split(".")[2] for n in names if n.startswith("model.layers.")} == {"2", "3"}
    assert "model.embed_tokens.weight" not in names and "lm_head.weight" in names  # tied: the last stage's copy
    assert "model.norm.weight" in names
    assert not any(t.is_meta for t in [*last.parameters(), *last.buffers()])
    assert last.get_submodule("model.rotary_emb").inv_freq.abs().sum() > 0  # recomputed by the model's _init_weights
    first = stage.chunk(range(0, 2), pre=True, post=False)
    assert {n.split(".")[1] for n in checkpoint_tensors(first)} == {"embed_tokens", "layers"}


def test_a_build_without_weights_is_initialised_and_runs(models, groups1):
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.schedule import forward_logits

    path, ref = models["phi"]
    chunks = build_model(_spec(path), Layout())
    assert all(torch.isfinite(p).all() for p in chunks[0].parameters())
    logits = forward_logits(chunks, ref["input_ids"])
    assert logits is not None and torch.isfinite(logits[..., :250]).all()


def test_the_export_loads_in_transformers_with_equal_logits(models, groups1, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import export_hf_weights, load_hf_weights

    path, ref = models["gpt_neox"]
    spec = _spec(path)
    chunks = build_model(spec, Layout(), load_weights=True)
    load_hf_weights(chunks, spec, path)
    export_hf_weights(chunks, spec, tmp_path / "out", source_dir=path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model(ref["input_ids"]).logits - ref["logits"]).abs().max() < TOL
