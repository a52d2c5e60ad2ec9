"""Mapping primitives as pure tensor functions: HF -> rank shards -> HF, bit-exact.

No processes, no megatron import: these are the functions the online loader, the export and
the offline converter all call.
"""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge.layout import Layout, dist_ckpt_key, local_experts, renumber, to_local_name
from megatron_bridge.bridge.mapping import COLUMN, GATE_UP, QKV, REPLICATED, ROW, VOCAB
from megatron_bridge.bridge.shards import FULL, Shapes, Shard
from megatron_bridge.bridge.table import Mapping, resolve_hf, resolve_megatron


def _shards(m, hf, tp, shapes):
    return [m.shard(hf, Shard(r, tp), shapes) for r in range(tp)]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


SHAPES = Shapes(num_attention_heads=8, num_query_groups=2, head_dim=4, vocab_size=10, padded_vocab_size=16)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_row_replicated_round_trip(tp):
    w = torch.randn(8, 12)
    for t in (COLUMN, ROW, REPLICATED):
        parts = _shards(t, [w], tp, SHAPES)
        assert _same(t.merge(parts, SHAPES), (w,))
    assert torch.equal(COLUMN.shard([w], Shard(1, 2), SHAPES), w[4:])
    assert torch.equal(ROW.shard([w], Shard(1, 2), SHAPES), w[:, 6:])


def _qkv(shapes, cols=3):
    """q/k/v whose rows say which head (and kind) they belong to."""
    d, g, h = shapes.head_dim, shapes.num_query_groups, shapes.num_attention_heads
    q = torch.arange(h).repeat_interleave(d).float()[:, None].repeat(1, cols)
    k = 100 + torch.arange(g).repeat_interleave(d).float()[:, None].repeat(1, cols)
    v = 200 + torch.arange(g).repeat_interleave(d).float()[:, None].repeat(1, cols)
    return q, k, v


def test_qkv_is_fused_per_query_group():
    q, k, v = _qkv(SHAPES)
    fused = QKV.shard([q, k, v], FULL, SHAPES)[:, 0]
    heads = fused.reshape(-1, SHAPES.head_dim)[:, 0].tolist()  # one entry per head slot
    assert heads == [0, 1, 2, 3, 100, 200, 4, 5, 6, 7, 101, 201]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])  # 4 and 8 > 2 KV groups: a rank holds part of a group
def test_qkv_round_trip_weight_and_bias(tp):
    q, k, v = (torch.randn(x.shape) for x in _qkv(SHAPES))
    parts = _shards(QKV, [q, k, v], tp, SHAPES)
    assert torch.equal(torch.cat(parts), QKV.shard([q, k, v], FULL, SHAPES))  # TP = contiguous rows
    assert _same(QKV.merge(parts, SHAPES), (q, k, v))
    qb, kb, vb = q[:, 0].clone(), k[:, 0].clone(), v[:, 0].clone()
    assert _same(QKV.merge(_shards(QKV, [qb, kb, vb], tp, SHAPES), SHAPES), (qb, kb, vb))


def test_qkv_rejects_wrong_head_geometry():
    q, k, v = _qkv(SHAPES)
    with pytest.raises(ValueError, match="do not match"):
        QKV.shard([q[:-4], k, v], FULL, SHAPES)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_rank_layout_is_cat_of_each_half(tp):
    gate, up = torch.randn(8, 5), torch.randn(8, 5)
    parts = _shards(GATE_UP, [gate, up], tp, SHAPES)
    n = 8 // tp
    for r, p in enumerate(parts):  # megatron's SwiGLU shard: [gate_r; up_r]
        assert torch.equal(p, torch.cat([gate[r * n : (r + 1) * n], up[r * n : (r + 1) * n]]))
    assert torch.equal(GATE_UP.shard([gate, up], FULL, SHAPES), torch.cat([gate, up]))  # dist-ckpt layout
    assert _same(GATE_UP.merge(parts, SHAPES), (gate, up))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_padding_zero_rows_dropped_on_merge(tp):
    emb = torch.randn(10, 3)
    parts = _shards(VOCAB, [emb], tp, SHAPES)
    assert sum(p.shape[0] for p in parts) == 16
    full = torch.cat(parts)
    assert torch.equal(full[:10], emb) and not full[10:].any()
    assert _same(VOCAB.merge(parts, SHAPES), (emb,))
    with pytest.raises(ValueError, match="rows"):
        VOCAB.shard([torch.randn(11, 3)], FULL, SHAPES)


def test_lazy_slices_give_the_same_shards(tmp_path):
    """The loader's lazy slices (the converter's positioned reader) give the shards of the
    in-memory tensors: row ranges, column bands (ROW) and the vocab padding."""
    from safetensors.torch import save_file

    from megatron_bridge.bridge.loader import HFCheckpoint

    q, k, v = (torch.randn(x.shape) for x in _qkv(SHAPES))
    tensors = {"q": q, "k": k, "v": v, "emb": torch.randn(10, 3), "o": torch.randn(6, 32)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with HFCheckpoint(tmp_path) as ck:
        lazy = {n: ck.slice(n) for n in tensors}
        assert lazy["q"].dtype == torch.float32 and tuple(lazy["q"].shape) == tuple(q.shape)
        assert torch.equal(lazy["o"][1:4, 8:16], tensors["o"][1:4, 8:16]) and torch.equal(
            lazy["o"].full(), tensors["o"]
        )
        with pytest.raises(TypeError, match="slices are read lazily"):
            lazy["o"][::2]
        for tp in (1, 2, 4):
            for r in range(tp):
                s = Shard(r, tp)
                assert torch.equal(
                    QKV.shard([lazy["q"], lazy["k"], lazy["v"]], s, SHAPES), QKV.shard([q, k, v], s, SHAPES)
                )
                assert torch.equal(VOCAB.shard([lazy["emb"]], s, SHAPES), VOCAB.shard([tensors["emb"]], s, SHAPES))
                assert torch.equal(ROW.shard([lazy["o"]], s, SHAPES), ROW.shard([tensors["o"]], s, SHAPES))


TABLE = (
    Mapping("embedding.word_embeddings.weight", "model.embed_tokens.weight", VOCAB),
    Mapping(
        "decoder.layers.{layer}.mlp.linear_fc1.weight",
        ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
        GATE_UP,
    ),
    Mapping(
        "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight",
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        ROW,
    ),
)


def test_resolve_groups_multi_tensor_rows_and_reports_leftovers():
    keys = [
        "model.embed_tokens.weight",
        "model.layers.3.mlp.up_proj.weight",
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.7.down_proj.weight",
        "model.layers.0.self_attn.rotary_emb.inv_freq",
    ]
    rows, left = resolve_hf(TABLE, keys)
    assert left == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    names = {r.megatron: r for r in rows}
    assert names["decoder.layers.3.mlp.linear_fc1.weight"].hf == (
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
    )
    expert = names["decoder.layers.1.mlp.experts.local_experts.7.linear_fc2.weight"]
    assert expert.mapping.is_expert and expert.layer == 1 and expert.expert == 7
    with pytest.raises(KeyError, match="up_proj"):
        resolve_hf(TABLE, ["model.layers.3.mlp.gate_proj.weight"])  # half a fused row
    r = resolve_megatron(TABLE, "decoder.layers.12.mlp.linear_fc1.weight")
    assert r.hf[0] == "model.layers.12.mlp.gate_proj.weight"
    assert resolve_megatron(TABLE, "decoder.layers.x.mlp.linear_fc1.weight") is None


def test_mapping_checks_arity_and_conditions():
    with pytest.raises(ValueError, match="takes 3"):
        Mapping("a", ("b", "c"), QKV)

    class Spec:
        tie_word_embeddings = True

    assert Mapping("o", "e", VOCAB, when="tie_word_embeddings").active(Spec())
    assert not Mapping("o", "l", VOCAB, when="!tie_word_embeddings").active(Spec())


def test_global_and_local_names():
    g = "decoder.layers.5.mlp.experts.local_experts.6.linear_fc1.weight"
    assert (
        to_local_name(g, range(4, 6), local_experts(8, 4, 3))
        == "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    )
    assert to_local_name(g, range(0, 4), None) is None
    assert to_local_name(g, range(4, 6), local_experts(8, 4, 0)) is None
    assert renumber("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight", 4, 6) == g
    assert to_local_name("embedding.word_embeddings.weight", range(2, 4)) == "embedding.word_embeddings.weight"
    assert (
        dist_ckpt_key("decoder.layers.0.input_layernorm.weight")
        == "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    )
    assert (
        dist_ckpt_key("decoder.layers.0.pre_mlp_layernorm.weight")
        == "decoder.layers.0.mlp.linear_fc1.layer_norm_weight"
    )


def test_layout_parse():
    assert Layout.parse("tp2pp2vpp2") == Layout(tp=2, pp=2, vpp=2)
    assert Layout.parse("cp2·tp2") == Layout(tp=2, cp=2)
    assert Layout.parse("ep2etp1tp2sp") == Layout(tp=2, ep=2, etp=1, sequence_parallel=True)
    assert Layout.parse("tp2pp2vpp2").describe() == "tp2·pp2·vpp2·cp1·ep1"
    with pytest.raises(ValueError):
        Layout.parse("dp2x")
