"""Fused tensors transformers concatenates at load (backends/transformers/fused.py): the linear-attention
hybrids' q/k/v convs are one table row of three checkpoint tensors, a tiny Kimi-Linear loads
and exports bit-exactly in one process (tp1, gloo) with transformers' logits; Qwen4-Exp's n-gram
table, saved in `split_ngram_parts` row pieces and split over TP by its columns, is one row of those
pieces, each TP rank reading its column slice of every piece, and loads and exports bit-exactly
too. TP2 runs in the matrix (`mbr verify --matrix`, docs/bridge.md)."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.backends.transformers.fused import Concatenated, ConcatenatedColumns
from megatron_bridge.bridge.shards import Shapes, Shard

TOL = 1e-5
SHAPES = Shapes(num_attention_heads=2, num_query_groups=2, head_dim=4, vocab_size=8, padded_vocab_size=8)


def test_concatenated_joins_the_pieces_and_splits_them_as_transformers_chunk_does():
    pieces = [torch.randn(3, 1, 4), torch.randn(3, 1, 4), torch.randn(2, 1, 4)]  # torch.chunk's sizes of 8 rows
    t = Concatenated(3).shard(pieces, Shard(1, 2), SHAPES)  # every TP rank holds it whole
    assert torch.equal(t, torch.cat(pieces))
    back = Concatenated(3).merge([t, t.clone()], SHAPES)
    assert all(torch.equal(a, b) for a, b in zip(back, pieces, strict=True))
    cols = [torch.randn(2, 3), torch.randn(2, 5)]
    assert torch.equal(Concatenated(2, dim=1).shard(cols, Shard(0, 1), SHAPES), torch.cat(cols, 1))


def test_concatenated_columns_gives_each_rank_its_columns_of_every_piece():
    pieces = [torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 4)]  # torch.chunk's sizes of 8 rows
    cat = torch.cat(pieces)
    shards = [ConcatenatedColumns(3).shard(pieces, Shard(r, 2), SHAPES) for r in range(2)]
    assert all(torch.equal(t, cat[:, 2 * r : 2 * r + 2]) for r, t in enumerate(shards))
    back = ConcatenatedColumns(3).merge(shards, SHAPES)
    assert all(torch.equal(a, b) for a, b in zip(back, pieces, strict=True))
    assert torch.equal(ConcatenatedColumns(3).shard(pieces, Shard(0, 1), SHAPES), cat)


def test_only_whole_tensors_of_literal_concatenating_converters_are_fused():
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    from megatron_bridge.backends.transformers.fused import fused

    conv = WeightConverter(["a.q_conv.weight", r"a\.k_conv.weight"], "a.conv.weight", operations=[Concatenate(dim=0)])
    assert fused([conv], {"m.a.conv.weight": "replicated"}) == {
        "m.a.conv.weight": (("m.a.q_conv.weight", "m.a.k_conv.weight"), 0)
    }
    assert fused([conv], {"m.a.conv.weight": "column"}) == {}  # a TP split of a concatenation: still refused
    regex = WeightConverter(["a.(q|k)_conv.weight", "b.w"], "a.conv.weight", operations=[Concatenate(dim=0)])
    stack = WeightConverter(
        ["a.q_conv.weight", "a.k_conv.weight"], "a.conv.weight", operations=[MergeModulelist(dim=0)]
    )
    assert fused([regex, stack], {"m.a.conv.weight": "replicated"}) == {}
    # a config-given count of row pieces (Qwen4-Exp's n-gram table), its columns split over TP
    shards = WeightConverter(
        "e.shard_*.weight", "e.weight", operations=[Concatenate(dim=0, num_shards_attribute="parts")]
    )

    class Cfg:
        parts = 3

        def get_text_config(self):
            return self

    assert fused([shards], {"m.e.weight": "row"}, Cfg()) == {
        "m.e.weight": (("m.e.shard_0.weight", "m.e.shard_1.weight", "m.e.shard_2.weight"), 0)
    }
    assert fused([shards], {"m.e.weight": "row"}) == {}  # no config: the count is unknown


@pytest.mark.parametrize(
    ("model_type", "fused", "pieces"),
    [
        ("kimi_linear", "model.layers.0.self_attn.conv1d.weight", "model.layers.0.self_attn.{}_conv1d.weight"),
        ("olmo_hybrid", "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.{}_conv1d.weight"),
        # renamed too: the checkpoint's `attention` is the model's `self_attn`
        ("bailing_hybrid", "model.layers.0.self_attn.conv1d.weight", "model.layers.0.attention.{}_conv1d.weight"),
    ],
)
def test_a_fused_conv_is_one_row_of_the_checkpoints_q_k_v_pieces(model_type, fused, pieces):
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.backends.transformers.backend import meta
    from megatron_bridge.runtime.hf_tiny import tiny_config
    from megatron_bridge.stream import in_model_layout

    spec = describe_hf(tiny_config(model_type).to_dict(), backend="transformers", make_vocab_size_divisible_by=1)
    m = meta(spec)
    assert m.kinds[fused] in ("replicated", "grad_allreduce")
    assert m.fused[fused] == (tuple(pieces.format(p) for p in "qkv"), 0)
    assert fused not in m.saved_as
    # streamed in transformers' layout (stream.py, layout="model"): the pieces arrive as the fused conv
    parts = [torch.randn(n, 1, 4) for n in (3, 3, 2)]
    got = list(in_model_layout(iter(zip((pieces.format(p) for p in "qkv"), parts, strict=True)), spec))
    assert [n for n, _ in got] == [fused] and torch.equal(got[0][1], torch.cat(parts))


def test_kimi_linear_loads_and_exports_bit_exactly_with_transformers_logits(groups1, tmp_path):
    from safetensors import safe_open

    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.hf_tiny import make_tiny
    from megatron_bridge.runtime.parity import check_layout, hf_reference, make_batch

    path = make_tiny("kimi_linear", tmp_path / "kimi")
    ids, _ = make_batch(250, batch=1, seq=8)
    ref = hf_reference(path, ids)
    res = check_layout(
        path, Layout(), ["logits", "roundtrip"], ref=ref, input_ids=ids, export_dir=tmp_path, backend="transformers"
    )
    assert res["logits"]["max_abs"] < TOL, res["logits"]
    assert res["roundtrip"]["ok"], res["roundtrip"]  # every source tensor back, bit-exact, nothing else
    with safe_open(str(next((tmp_path / "roundtrip").glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.q_conv1d.weight" in names and not any(".conv1d." in n for n in names)


def test_qwen4_exp_ngram_table_in_row_pieces_loads_and_exports_bit_exactly(groups1, tmp_path):
    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.backends.transformers.backend import TransformersBackend
    from megatron_bridge.bridge.hf_config import read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.hf_tiny import make_tiny
    from megatron_bridge.runtime.parity import check_layout, hf_reference, make_batch

    path = make_tiny("qwen4_exp_text", tmp_path / "qwen4")  # its table saved in two pieces
    spec = describe_hf(read_hf_config(path), backend="transformers", make_vocab_size_divisible_by=1)
    table = "model.layers.{layer}.ple.ple_embedding.ngram_embedding.weight"
    row, held = [r for r in TransformersBackend().table(spec) if r.megatron == table]  # saved in pieces, or joined
    assert held.hf == (table,) and not isinstance(held.transform, ConcatenatedColumns)
    assert isinstance(row.transform, ConcatenatedColumns) and list(row.hf) == [
        f"model.layers.{{layer}}.ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(2)
    ]
    ids, _ = make_batch(250, batch=1, seq=16)
    ref = hf_reference(path, ids)
    res = check_layout(
        path, Layout(), ["logits", "roundtrip"], ref=ref, input_ids=ids, export_dir=tmp_path, backend="transformers"
    )
    assert res["logits"]["max_abs"] < TOL, res["logits"]
    assert res["roundtrip"]["ok"], res["roundtrip"]  # both pieces back under their names, bit-exact
