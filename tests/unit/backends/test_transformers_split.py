"""A vision tower's q/k/v cut from its fused checkpoint tensor, rotary heads permuted
(backends/transformers/split.py): every row reads exactly the tensor transformers' from_pretrained
builds, and the merged rows joined are the bytes save_pretrained wrote (the oracle)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("model_type", ["qianfan_ocr", "step3p7", "mistral_large4"])
def test_split_rows_round_trip_bit_exactly_against_transformers(model_type, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.backends.transformers.backend import meta
    from megatron_bridge.backends.transformers.split import ChunkPiece
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.mapping import join_pieces
    from megatron_bridge.bridge.shards import FULL
    from megatron_bridge.runtime.hf_tiny import make_tiny

    path = make_tiny(model_type, tmp_path / model_type)
    spec = describe_hf(read_hf_config(path), backend="transformers", make_vocab_size_divisible_by=1)
    m, shapes = meta(spec), spec.shapes(1)
    assert m.split
    saved = {k: v for f in path.glob("*.safetensors") for k, v in load_file(f).items()}
    held = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).state_dict()
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for name, c in m.split.items():
        tf = ChunkPiece(c.at, c.rows, c.nth, c.pieces, c.heads)
        assert torch.equal(tf.shard([saved[c.source]], FULL, shapes), held[name]), name
        parts.setdefault(c.source, {})[c.nth] = tf.merge([held[name]], shapes)[0]
    for source, got in parts.items():
        assert torch.equal(join_pieces([got[i] for i in sorted(got)]), saved[source]), source
