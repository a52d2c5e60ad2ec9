"""`HFExport` behind the loop (runtime/hf_export.py): the same bytes as in the step, a bounded
queue, publication by rename, a writer's failure raised by finish(); and what makes queuing
safe while training goes on: the exporter's tensors never share a parameter's memory."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

from megatron_bridge.convert.formats.manifest import file_crc32
from megatron_bridge.runtime import hf_export
from megatron_bridge.runtime.hf_export import HFExport


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.w": torch.randn(64, 32 + i, generator=g) for i in range(6)} | {
        "lm_head.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)
    }


def _index(out, rows, crcs):
    (out / "index.json").write_text(json.dumps([rows, crcs]))


def test_background_bytes_equal_the_in_step_export_and_the_queue_stays_bounded(groups1, tmp_path, monkeypatch):
    tensors = _tensors()
    HFExport(tmp_path / "step", iter(tensors.items()), _index).finish()
    biggest = max(t.numel() * t.element_size() for t in tensors.values())
    peak, gate = [0], threading.Event()
    real_add = hf_export.StreamingSafetensors.add

    def slow_add(self, name, t):  # the writer waits for the test: the queue fills up
        gate.wait(timeout=30)
        real_add(self, name, t)

    monkeypatch.setattr(hf_export.StreamingSafetensors, "add", slow_add)
    real_put = HFExport._put

    def watched_put(self, name, host):
        real_put(self, name, host)
        peak[0] = max(peak[0], self._queued)

    monkeypatch.setattr(HFExport, "_put", watched_put)
    threading.Timer(0.5, gate.set).start()  # the writer is held for 0.5 s: unbounded, all 7 would queue
    fresh = ((k, v.clone()) for k, v in tensors.items())  # as the exporter's are: new memory
    exp = HFExport(tmp_path / "bg.tmp", fresh, _index, buffer_bytes=2 * biggest, publish_as=tmp_path / "bg")
    assert exp.finish() == tmp_path / "bg"
    assert biggest <= peak[0] <= 2 * biggest < sum(t.numel() * t.element_size() for t in tensors.values())
    assert not (tmp_path / "bg.tmp").exists() and not list((tmp_path / "bg").glob(".*spill"))
    name = "model-00001-of-00001.safetensors"
    assert (tmp_path / "bg" / name).read_bytes() == (tmp_path / "step" / name).read_bytes()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "ref"), metadata={"format": "pt"})
    assert (tmp_path / "bg" / name).read_bytes() == (tmp_path / "ref").read_bytes()
    rows, crcs = json.loads((tmp_path / "bg" / "index.json").read_text())
    assert [rows, crcs] == json.loads((tmp_path / "step" / "index.json").read_text())
    assert crcs == {name: file_crc32(tmp_path / "bg" / name)}  # what a later load checks


def test_a_writer_failure_is_raised_by_finish_and_nothing_is_published(groups1, tmp_path, monkeypatch):
    def broken_add(self, name, t):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_export.StreamingSafetensors, "add", broken_add)
    exp = HFExport(
        tmp_path / "x.tmp", iter(_tensors().items()), _index, buffer_bytes=1 << 20, publish_as=tmp_path / "x"
    )
    with pytest.raises(RuntimeError, match=r"was not written: rank 0: OSError: .*No space left"):
        exp.finish()
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_exported_tensors_never_share_a_parameters_memory(groups1, tmp_path, family):
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import iter_hf_tensors

    spec = load_spec(make_tiny(family, tmp_path / "hf"))
    chunks = build_model(spec, Layout())
    owned = {t.untyped_storage().data_ptr() for c in chunks for t in [*c.parameters(), *c.buffers()]}
    got = list(iter_hf_tensors(chunks, spec))
    assert got and not [n for n, t in got if t.untyped_storage().data_ptr() in owned]
