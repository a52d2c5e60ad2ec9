"""The streaming safetensors writer against the library's own `save_file`, byte for byte."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_bridge.runtime.safetensors_stream import StreamingSafetensors

MOE = "gpt_oss"  # stacked experts: the exporter assembles whole HF tensors from per-expert ones


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.1.mlp.weight": torch.randn(5, 3, generator=g),
        "model.layers.0.mlp.weight": torch.randn(7, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "b.steps": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "a.mask": torch.tensor([True, False, True]),
        "a.scalar": torch.tensor(3.5, dtype=torch.float64),
        "z.empty": torch.zeros(0, 4),
        "c.i32": torch.arange(3, dtype=torch.int32),
        "d.u8": torch.arange(5, dtype=torch.uint8),
        "e.fp8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "m.transposed": torch.randn(3, 4, generator=g).t(),  # not contiguous
    }


def test_bytes_equal_save_file_whatever_the_arrival_order(tmp_path):
    tensors = _tensors()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"}
    )
    for i, order in enumerate((list(tensors), sorted(tensors, reverse=True))):
        w = StreamingSafetensors(tmp_path / f"spill{i}")
        for k in order:
            w.add(k, tensors[k])
        w.finish(tmp_path / f"out{i}.safetensors", metadata={"format": "pt"})
        assert (tmp_path / f"out{i}.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
        assert not (tmp_path / f"spill{i}").exists()
    got = load_file(str(tmp_path / "out0.safetensors"))
    assert all(
        torch.equal(got[k].reshape(-1).view(torch.uint8), tensors[k].contiguous().reshape(-1).view(torch.uint8))
        for k in tensors
    )


def test_copy_in_small_pieces(tmp_path, monkeypatch):
    import megatron_bridge.runtime.safetensors_stream as mod

    monkeypatch.setattr(mod, "COPY_BUFFER", 7)  # many partial reads per tensor
    tensors = {k: v.contiguous() for k, v in _tensors().items()}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    w = StreamingSafetensors(tmp_path / "spill")
    for k, v in tensors.items():
        w.add(k, v)
    w.finish(tmp_path / "out.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "out.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


@pytest.mark.parametrize(("family", "dtype"), [("llama", None), (MOE, torch.bfloat16)])
def test_export_writes_what_save_file_of_the_gathered_tensors_wrote(groups1, tmp_path, family, dtype):
    """`export_hf_weights` (streamed) against the former writer, `save_file` of every gathered
    tensor held at once: the same bytes, and no spill left behind."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import export_hf_weights, iter_hf_tensors, load_hf_weights

    hf = make_tiny(family, tmp_path / "hf")
    spec = load_spec(hf)
    chunks = build_model(spec, Layout(), load_weights=True)
    load_hf_weights(chunks, spec, hf)
    out = export_hf_weights(chunks, spec, tmp_path / "out", source_dir=hf, dtype=dtype)
    save_file(dict(iter_hf_tensors(chunks, spec, dtype)), str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert not list(out.glob(".*spill"))
    assert (out / "model-00001-of-00001.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
