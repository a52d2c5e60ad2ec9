"""The hf matrix's in-process half (`mbr verify --matrix model.backend=hf`): a refused
architecture is one row with the refusal's first reason; the launches are the full command's."""

from megatron_bridge.bridge.hf_config import UnsupportedFeatures
from megatron_bridge.commands import verify_matrix_hf as V


def test_a_refusal_is_its_first_reason_on_one_line():
    e = UnsupportedFeatures("X cannot run on the hf backend yet:\n  - no pp plan\n  - experts | 4")
    assert V.refusal(e) == "no pp plan (+1 more)"
    assert V.refusal(UnsupportedFeatures("one | line")) == "one / line"


def test_a_model_the_backend_refuses_is_one_refused_row(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise UnsupportedFeatures("MixtralForCausalLM cannot run on the hf backend yet:\n  - a missing piece")

    monkeypatch.setattr(V, "describe_hf", refuse)  # which models are refused changes as the backend grows
    out = V.prepare("mixtral", tmp_path, V.LAYOUTS)
    assert out == {"*": "a missing piece"}
    assert not (tmp_path / "mixtral.ref.pt").exists()


def test_an_ep_layout_of_a_dense_model_is_no_row_and_needs_no_reference(tmp_path):
    assert V.prepare("cohere", tmp_path, ["ep2"]) == {"ep2": V.NOT_MOE}
    assert not (tmp_path / "cohere.ref.pt").exists()
