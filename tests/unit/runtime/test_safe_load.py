"""`train.init_from` and HF loading into a live model (one process, tp1): a payload in a
converted checkpoint is refused by the load itself, not only by the trainer's preflight; an HF
directory with pickled weights only, or a FIFO for weights, is refused without blocking."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from megatron_bridge.errors import UserError
from tests.payloads import payload_in_extra_state, payload_in_rank_file, pickle_file

REFUSED = f"was refused: it holds a `{open.__module__}.open` object"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.cli import main as mbr
    from megatron_bridge.runtime.tiny import make_tiny

    base = tmp_path_factory.mktemp("tiny")
    hf = Path(make_tiny("llama", base / "hf"))
    for fmt in ("torch_dist", "torch"):
        assert mbr(["convert", f"src={hf}", f"dst={base / fmt}", f"format={fmt}", "progress=off"]) == 0
    return base, load_spec(hf)


def _chunks(spec):
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model

    return build_model(spec, Layout(), load_weights=True)


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_init_from_payload_is_refused_at_load(groups1, tiny, tmp_path, fmt):
    from megatron_bridge.runtime.load_converted import load_converted

    base, spec = tiny
    out = tmp_path / fmt
    shutil.copytree(base / fmt, out)
    marker = tmp_path / "MARKER"
    (payload_in_extra_state if fmt == "torch_dist" else payload_in_rank_file)(out, marker)
    with pytest.raises(UserError, match=REFUSED):
        load_converted(_chunks(spec), spec, out)
    assert not marker.exists()
    load_converted(_chunks(spec), spec, base / fmt)  # the clean one loads


def test_hf_dir_with_pickled_weights_only_is_refused(groups1, tiny, tmp_path):
    from megatron_bridge.train.init import load_initial_weights

    base, spec = tiny
    d = tmp_path / "hf_bin"
    d.mkdir()
    shutil.copy(base / "hf" / "config.json", d / "config.json")
    marker = tmp_path / "MARKER"
    pickle_file(d / "pytorch_model.bin", marker)
    with pytest.raises(UserError, match="neither a Hugging Face model directory"):
        load_initial_weights(_chunks(spec), spec, str(d))
    assert not marker.exists()


def test_hf_weights_fifo_is_refused_not_opened(groups1, tiny, tmp_path):
    from megatron_bridge.runtime.weights import load_hf_weights

    base, spec = tiny
    d = tmp_path / "hf_fifo"
    shutil.copytree(base / "hf", d)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")
    chunks = _chunks(spec)
    box: list[BaseException | None] = [None]

    def run():
        try:
            load_hf_weights(chunks, spec, d)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the loader opened the FIFO"
    assert isinstance(box[0], UserError) and "is a FIFO (named pipe)" in str(box[0])
