"""`gather_merged`'s placement: every rank's shard received into its place in the HF tensors
(runtime/weights_base.py) equals `Transform.merge` of the gathered shards, bit for bit, for
every blockwise transform the tables use, with the receive buffer shrunk so shards travel in
several chunks. The collectives themselves run in tests/dist/test_convert_dist.py (stream)."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.backends.transformers.experts import StackedExperts, WholeStackedExperts
from megatron_bridge.bridge.mapping import COLUMN, GATE_UP, QKV, REPLICATED, ROW, VOCAB
from megatron_bridge.bridge.shards import Shapes, Shard, out_shape
from megatron_bridge.bridge.stacked import STACKED_GATE_UP, STACKED_QKV, ExpertsStacked
from megatron_bridge.runtime import weights_base
from megatron_bridge.runtime.weights_base import _pieces, _place, gather_merged

SHAPES = Shapes(num_attention_heads=8, num_query_groups=2, head_dim=4, vocab_size=50, padded_vocab_size=64)
Q, KV, H, F = 32, 8, 12, 16  # q rows, k/v rows, hidden, ffn
CASES = {  # transform -> its HF inputs' shapes
    "column": (COLUMN, [(F, H)]),
    "row": (ROW, [(H, F)]),
    "vocab": (VOCAB, [(50, H)]),
    "qkv": (QKV, [(Q, H), (KV, H), (KV, H)]),
    "qkv bias": (QKV, [(Q,), (KV,), (KV,)]),
    "gate_up": (GATE_UP, [(F, H), (F, H)]),
    "stacked qkv": (STACKED_QKV, [(Q + 2 * KV, H)]),
    "stacked gate_up": (STACKED_GATE_UP, [(2 * F, H)]),
    "experts gate_up": (ExpertsStacked(GATE_UP, "gate_up"), [(1, H, 2 * F)]),
    "experts gate_up bias": (ExpertsStacked(GATE_UP, "gate_up"), [(1, 2 * F)]),
    "experts down": (ExpertsStacked(ROW, "linear"), [(1, F, H)]),
    # the transformers backend's stacked experts [E, rows, cols], split inside each expert (a `view` block)
    "stacked experts column": (WholeStackedExperts("column", 1), [(3, F, H)]),
    "stacked experts column packs 2": (WholeStackedExperts("column", 2), [(3, 2 * F, H)]),
    "stacked experts row": (WholeStackedExperts("row", 1), [(3, H, F)]),
    "stacked experts row packs 2": (WholeStackedExperts("row", 2), [(3, H, 2 * F)]),
}


def _received_in_place(tf, shards: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """gather_merged's receiving side with the transport taken out: a piece with a place is
    copied there (the receive), the others go through `_place` (the receive buffer)."""
    n = len(shards)
    meta = torch.empty(shards[0].shape, dtype=shards[0].dtype, device="meta")
    hf_shapes = [tuple(x.shape) for x in tf.merge([meta] * n, SHAPES)]
    outs = tuple(torch.full(s, float("nan"), dtype=shards[0].dtype) for s in hf_shapes)  # unfilled shows
    for i, shard in enumerate(shards):
        blocks = tf.blocks(hf_shapes, Shard(i, n), SHAPES)
        shard = shard.view(out_shape(blocks, hf_shapes))  # as gather_merged reads it
        assert sum(b.n for b in blocks) == shard.shape[0]
        for a, b, dest in _pieces(blocks, shard, outs):
            if dest is not None:
                dest.copy_(shard[a:b])
            else:
                _place(blocks, a, shard[a:b], outs)
    return outs


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_received_in_place_equals_merge(case, n, monkeypatch):
    monkeypatch.setattr(weights_base, "GATHER_CHUNK_BYTES", 3 * 4 * H)  # a few rows per piece
    tf, hf_shapes = CASES[case]
    g = torch.Generator().manual_seed(0)
    hf = [torch.randn(s, generator=g) for s in hf_shapes]
    shards = [tf.shard(hf, Shard(i, n), SHAPES).contiguous() for i in range(n)]
    want = tf.merge(shards, SHAPES)
    got = _received_in_place(tf, shards)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want)), case
    assert all(torch.equal(a, b) for a, b in zip(got, hf)), case  # and the HF tensors themselves


def test_whole_transforms_declare_it():
    """A transform whose merge takes the first shard alone moves nothing to gather it."""
    assert REPLICATED.whole and ExpertsStacked(REPLICATED, "same").whole
    assert not any(tf.whole for tf, _ in CASES.values())


INTO_CASES = {  # transform -> its HF inputs' shapes: the received-in-place path, a whole one, the fallback
    **{k: CASES[k] for k in ("qkv", "experts down", "stacked experts row packs 2")},
    "whole": (REPLICATED, [(F, H)]),
    "not blockwise": (StackedExperts(3, 2, "column"), [(F, H)] * 6),
}


@pytest.mark.parametrize("case", sorted(INTO_CASES))
def test_into_lands_the_merge_where_the_receiver_wants_it(groups1, case):
    """`into` (a receiver's destinations, stream.py's layout="model" slots): gather_merged returns
    those very tensors, filled with the merge bit for bit, on every path; a destination of the
    wrong shape is ignored (new memory, same values)."""
    from megatron.core import parallel_state as ps

    tf, hf_shapes = INTO_CASES[case]
    g = torch.Generator().manual_seed(0)
    hf = [torch.randn(s, generator=g) for s in hf_shapes]
    shard = tf.shard(hf, Shard(0, 1), SHAPES).contiguous()
    want = tf.merge([shard], SHAPES)
    names = [f"t{i}" for i in range(len(want))]
    buf = torch.full((1 + sum(x.numel() for x in want),), float("nan"))  # slots of one bigger tensor
    slots, at = {}, 1
    for n, x in zip(names, want):
        slots[n], at = buf[at : at + x.numel()].view(x.shape), at + x.numel()
    if len(names) > 1:  # the last asks a misfit: ignored
        slots[names[-1]] = torch.empty(0)
    asked = []

    def into(name, shape, dtype, device):
        asked.append(name)
        return slots[name]

    got = gather_merged(shard, tf, SHAPES, ps.get_tensor_model_parallel_group(), names=names, into=into)
    assert got is not None and asked == names
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), case
    for n, t in zip(names, got):
        assert (t.data_ptr() == slots[n].data_ptr()) == (slots[n].numel() > 0), (case, n)
