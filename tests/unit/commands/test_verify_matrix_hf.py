"""The transformers matrix's in-process half (`mbr verify --matrix model.backend=transformers`): a refused
architecture is one row with the refusal's first reason; the launches are the full command's."""

from megatron_bridge.bridge.hf_config import UnsupportedFeatures
from megatron_bridge.commands import verify_matrix_transformers as V


def test_a_refusal_is_its_first_reason_on_one_line():
    e = UnsupportedFeatures("X cannot run on the transformers backend yet:\n  - no pp plan\n  - experts | 4")
    assert V.refusal(e) == "no pp plan (+1 more)"
    assert V.refusal(UnsupportedFeatures("one | line")) == "one / line"


def test_a_model_the_backend_refuses_is_one_refused_row(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise UnsupportedFeatures("MixtralForCausalLM cannot run on the transformers backend yet:\n  - a missing piece")

    monkeypatch.setattr(V, "describe_hf", refuse)  # which models are refused changes as the backend grows
    out = V.prepare("mixtral", tmp_path, V.LAYOUTS)
    assert out == {"*": "a missing piece"}
    assert not (tmp_path / "mixtral.ref.pt").exists()


def test_a_tiny_model_whose_classes_need_a_package_not_installed_is_refused_naming_it(tmp_path, monkeypatch):
    """FastVLM's and Gemma 3n's vision towers are timm's (TimmWrapperModel, transformers' own
    requires_backends): without timm the row is the backend's refusal of the config, its own
    blocker first (Gemma 3n's AltUp), else the package to install; never a FAIL."""
    from transformers.utils import import_utils

    monkeypatch.setitem(import_utils.BACKENDS_MAPPING, "timm", (lambda: False, import_utils.TIMM_IMPORT_ERROR))
    out = V.prepare("fast_vlm", tmp_path, ["tp2"], vlm=True)
    assert out == {"*": "FastVlmForConditionalGeneration needs the timm package (TimmWrapperModel), not installed"}
    assert V.prepare("gemma3n", tmp_path, ["tp2"], vlm=True)["*"].startswith("Gemma3nTextModel.forward: AltUp")


def test_a_config_with_non_finite_floats_is_described_and_refused_by_its_layers(tmp_path):
    """Mamba hybrids write time_step_limit's Infinity as {"__float__": "Infinity"}: decoded as
    transformers' reader does, the rows are named refusals or runs (here every layout runs:
    transformers' reference is made), never a FAIL."""
    from megatron_bridge.backends.transformers.backend import config_object

    cfg = config_object({"model_type": "nemotron_h", "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert cfg.time_step_limit[1] == float("inf")
    out = V.prepare("nemotron_h", tmp_path, V.LAYOUTS)
    assert not any(why.startswith("FAIL") for why in out.values()), out
    assert (tmp_path / "nemotron_h.ref.pt").is_file() and "*" not in out


def test_a_zero_dim_tensor_is_read_whole_and_merged_back(tmp_path):
    """Apertus' xIELU beta/eps are 0-dim persistent buffers: no rows for the block layout, so
    the table gives them the Scalar transform (whole on every rank, refused by the byte copier)."""
    import pytest
    import torch

    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.backends.transformers.backend import TransformersBackend
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.mapping import SCALAR, NotBlockwise
    from megatron_bridge.bridge.shards import Shard
    from megatron_bridge.runtime.hf_tiny import make_tiny

    spec = describe_hf(read_hf_config(make_tiny("apertus", tmp_path / "apertus")), backend="transformers")
    scalars = [r.megatron for r in TransformersBackend().table(spec) if r.transform is SCALAR]
    assert scalars == ["model.layers.{layer}.mlp.act_fn.beta", "model.layers.{layer}.mlp.act_fn.eps"], scalars
    t = torch.tensor(0.5)
    assert SCALAR.shard([t], Shard(1, 2), spec.shapes(2)) is t and SCALAR.merge([t, t], spec.shapes(2)) == (t,)
    with pytest.raises(NotBlockwise):
        SCALAR.blocks([()], Shard(0, 2), spec.shapes(2))


def test_an_ep_layout_of_a_dense_model_is_no_row_and_needs_no_reference(tmp_path):
    assert V.prepare("cohere", tmp_path, ["ep2"]) == {"ep2": V.NOT_MOE}
    assert not (tmp_path / "cohere.ref.pt").exists()


def test_an_exception_in_a_launch_ends_it_at_once_and_names_the_error(tmp_path, monkeypatch, capsys):
    """A rank that raises may leave the others waiting on it (OLMoE's hang: a pipeline stage's
    error, its peer blocked in recv), so the worker ends the launch instead of going on to the
    next layout, and the launcher's row names the exception."""
    import json

    import pytest
    import torch

    torch.save({"input_ids": None, "labels": None}, tmp_path / "olmoe.ref.pt")

    def boom(*a, **k):
        raise RuntimeError("a view modified in place")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(V, "check_layout", boom)
    monkeypatch.setattr(V.os, "_exit", exit_)
    argv = ["--root", str(tmp_path), "--archs", "olmoe", "--layouts", json.dumps({"olmoe": ["tp2", "pp2"]})]
    with pytest.raises(SystemExit) as e:
        V.worker(argv)
    assert e.value.code == 1  # at the first layout, before pp2 and the closing barrier
    printed = capsys.readouterr().out

    def launch(*a, **k):
        raise V.TorchrunError("exited with code 1", output=f"[rank0]: noise\n{printed}")

    monkeypatch.setattr(V, "run_torchrun", launch)
    per_rank, why = V._launch(tmp_path, {"olmoe": ["tp2"]}, 10.0)
    assert per_rank == [] and why.startswith("olmoe/tp2: RuntimeError: a view modified in place at ")
