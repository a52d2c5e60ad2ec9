"""`Transform.blocks`: the one description of a rank's shard, checked against `shard`.

The offline converter copies a rank's tensor straight from the safetensors bytes by its
blocks, the online loader calls `shard`. Here the blocks are assembled with numpy (as bytes
would be) and must equal `shard` bit for bit, for every transform and several TP sizes,
including the awkward cases: vocab shards that are all padding, fewer KV groups than ranks.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_bridge.bridge.mapping import COLUMN, GATE_UP, QKV, REPLICATED, ROW, VOCAB
from megatron_bridge.bridge.shards import FULL, Block, Shapes, Shard, out_shape
from megatron_bridge.bridge.stacked import STACKED_GATE_UP, STACKED_QKV

SHAPES = Shapes(num_attention_heads=8, num_query_groups=2, head_dim=4, vocab_size=10, padded_vocab_size=16)
MQA = Shapes(num_attention_heads=8, num_query_groups=1, head_dim=4, vocab_size=10, padded_vocab_size=16)
MHA = Shapes(num_attention_heads=8, num_query_groups=8, head_dim=4, vocab_size=10, padded_vocab_size=16)


def qkv_shapes(s: Shapes, cols=(3,)):
    d, g = s.head_dim, s.num_query_groups
    return [(s.num_attention_heads * d, *cols), (g * d, *cols), (g * d, *cols)]


# (id, transform, HF input shapes, Shapes, shard sizes)
CASES = [
    ("replicated-1d", REPLICATED, [(8,)], SHAPES, [1, 2, 4]),
    ("replicated-2d", REPLICATED, [(8, 12)], SHAPES, [1, 2, 4]),
    ("column", COLUMN, [(8, 12)], SHAPES, [1, 2, 4, 8]),
    ("row", ROW, [(6, 12)], SHAPES, [1, 2, 3, 4, 6, 12]),
    ("vocab", VOCAB, [(10, 3)], SHAPES, [1, 2, 4, 8, 16]),
    ("qkv", QKV, qkv_shapes(SHAPES), SHAPES, [1, 2, 4, 8, 16]),
    ("qkv-bias", QKV, qkv_shapes(SHAPES, ()), SHAPES, [1, 2, 4, 8]),
    ("qkv-mqa", QKV, qkv_shapes(MQA), MQA, [1, 2, 4, 8]),
    ("qkv-mha", QKV, qkv_shapes(MHA), MHA, [1, 2, 4, 8]),
    ("gate-up", GATE_UP, [(8, 5), (8, 5)], SHAPES, [1, 2, 4, 8]),
    ("stacked-qkv", STACKED_QKV, [(48, 3)], SHAPES, [1, 2, 4, 8, 16]),  # Phi-3 qkv_proj: [q; k; v]
    ("stacked-qkv-mqa", STACKED_QKV, [(40, 3)], MQA, [1, 2, 4, 8]),
    ("stacked-gate-up", STACKED_GATE_UP, [(16, 5)], SHAPES, [1, 2, 4, 8]),  # Phi-3 gate_up_proj
]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_stacked_tensors_shard_as_their_separate_parts(tp):
    """A stacked HF tensor gives exactly the shards its separate parts give (so the fused
    megatron layout is the one verified for Llama), one block per contiguous range."""
    _, (qkv,) = inputs([(48, 3)])
    q, k, v = qkv[:32], qkv[32:40], qkv[40:]
    _, (gu,) = inputs([(16, 5)])
    for r in range(tp):
        s = Shard(r, tp)
        assert torch.equal(STACKED_QKV.shard([qkv], s, SHAPES), QKV.shard([q, k, v], s, SHAPES))
        assert torch.equal(STACKED_GATE_UP.shard([gu], s, SHAPES), GATE_UP.shard([gu[:8], gu[8:]], s, SHAPES))
    assert STACKED_GATE_UP.blocks([(16, 5)], Shard(0, 1), SHAPES) == [Block(0, (0, 16))]
    with pytest.raises(ValueError, match="stacked qkv has 47 rows"):
        STACKED_QKV.blocks([(47, 3)], Shard(0, 1), SHAPES)


def np_assemble(blocks, hf):
    """What the byte copier does: each block is a row range (or a 2-D column range) of one
    input, or zero rows; the shard is their concatenation."""
    parts = []
    for b in blocks:
        if b.src is None:
            parts.append(np.zeros((b.n,) + hf[0].shape[1:], hf[0].dtype))
        elif b.cols is None:
            parts.append(hf[b.src][b.rows[0] : b.rows[1]])
        else:
            assert hf[b.src].ndim == 2
            parts.append(hf[b.src][b.rows[0] : b.rows[1], b.cols[0] : b.cols[1]])
    return np.concatenate(parts, axis=0)


def inputs(shapes, dtype=np.float32):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(dtype) for s in shapes]
    return arrays, [torch.from_numpy(a.copy()) for a in arrays]


def maximal(blocks):
    """No block continues its predecessor (they would be one copy)."""
    return all(not (a.src == b.src and a.cols == b.cols and a.rows[1] == b.rows[0]) for a, b in zip(blocks, blocks[1:]))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_blocks_assemble_to_shard_and_merge_back(case):
    _, t, shapes_in, shapes, sizes = case
    arrays, tensors = inputs(shapes_in)
    for tp in sizes:
        shards = []
        for r in range(tp):
            blocks = t.blocks(shapes_in, Shard(r, tp), shapes)
            shard = t.shard(tensors, Shard(r, tp), shapes)
            ref = np_assemble(blocks, arrays)
            assert ref.dtype == shard.numpy().dtype and np.array_equal(ref, shard.numpy()), (tp, r, blocks)
            assert out_shape(blocks, shapes_in) == tuple(shard.shape)
            assert all(b.n > 0 for b in blocks) and maximal(blocks), blocks
            shards.append(shard)
        merged = t.merge(shards, shapes)
        assert len(merged) == len(tensors) and all(torch.equal(m, x) for m, x in zip(merged, tensors))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_contiguous_row_ranges_for_the_byte_copier(tp):
    """Column, gate/up and QKV with whole KV groups per rank need no column slicing: each
    block is one contiguous byte range of its file (copy_file_range)."""
    n = 8 // tp
    for r in range(tp):
        rows = (r * n, (r + 1) * n)
        assert COLUMN.blocks([(8, 12)], Shard(r, tp), SHAPES) == [Block(0, rows)]
        assert GATE_UP.blocks([(8, 5), (8, 5)], Shard(r, tp), SHAPES) == [Block(0, rows), Block(1, rows)]
        qkv = QKV.blocks(qkv_shapes(MHA), Shard(r, tp), MHA)  # 8 groups: whole groups for tp <= 8
        groups = range(r * 8 // tp, (r + 1) * 8 // tp)
        assert qkv == [
            b
            for g in groups
            for b in (Block(0, (4 * g, 4 * g + 4)), Block(1, (4 * g, 4 * g + 4)), Block(2, (4 * g, 4 * g + 4)))
        ]


def test_qkv_with_more_ranks_than_kv_groups_clips_to_the_shard():
    # 2 groups of [4 q heads, k, v] x head_dim 4 = 24 fused rows each; tp=4 gives 12 rows a rank
    got = [QKV.blocks(qkv_shapes(SHAPES), Shard(r, 4), SHAPES) for r in range(4)]
    assert got == [
        [Block(0, (0, 12))],
        [Block(0, (12, 16)), Block(1, (0, 4)), Block(2, (0, 4))],
        [Block(0, (16, 28))],
        [Block(0, (28, 32)), Block(1, (4, 8)), Block(2, (4, 8))],
    ]
    # tp=8: 6 rows a rank; rank 3 holds fused rows 18..24 = the end of k_0 and all of v_0
    assert QKV.blocks(qkv_shapes(SHAPES), Shard(3, 8), SHAPES) == [Block(1, (2, 4)), Block(2, (0, 4))]


def test_row_vocab_replicated_blocks():
    assert ROW.blocks([(6, 12)], Shard(2, 3), SHAPES) == [Block(0, (0, 6), (8, 12))]
    assert ROW.blocks([(6, 12)], FULL, SHAPES) == [Block(0, (0, 6))]  # unsplit: plain rows
    assert REPLICATED.blocks([(8,)], Shard(1, 4), SHAPES) == [Block(0, (0, 8))]
    assert VOCAB.blocks([(10, 3)], FULL, SHAPES) == [Block(0, (0, 10)), Block(None, (10, 16))]
    assert VOCAB.blocks([(10, 3)], Shard(2, 4), SHAPES) == [Block(0, (8, 10)), Block(None, (10, 12))]
    assert VOCAB.blocks([(10, 3)], Shard(3, 4), SHAPES) == [Block(None, (12, 16))]
    assert out_shape([Block(None, (12, 16))], [(10, 3)]) == (4, 3)


def test_all_padding_vocab_shard_keeps_the_dtype():
    emb = torch.randn(10, 3).to(torch.bfloat16)
    part = VOCAB.shard([emb], Shard(3, 4), SHAPES)
    assert part.dtype == torch.bfloat16 and part.shape == (4, 3) and not part.any()


def test_single_full_block_is_not_copied():
    w = torch.randn(8, 12)
    assert REPLICATED.shard([w], Shard(1, 2), SHAPES) is w
    assert COLUMN.shard([w], Shard(1, 2), SHAPES).data_ptr() == w[4:].data_ptr()  # a view


@pytest.mark.parametrize(
    "t, shapes_in, s, match",
    [
        (QKV, [(28, 3), (8, 3), (8, 3)], FULL, "q/k/v rows 28/8/8 do not match heads=8, kv groups=2, head_dim=4"),
        (QKV, [(32, 3), (8, 4), (8, 3)], FULL, "differ past the first dimension"),
        (QKV, qkv_shapes(SHAPES), Shard(0, 5), "fused QKV rows: size 48 is not divisible by 5 shards"),
        (VOCAB, [(11, 3)], FULL, "vocab table has 11 rows, config says 10"),
        (VOCAB, [(10, 3)], Shard(0, 3), "padded vocab: size 16 is not divisible by 3 shards"),
        (COLUMN, [(8, 12)], Shard(0, 3), "column-parallel rows: size 8 is not divisible by 3 shards"),
        (ROW, [(8, 12)], Shard(0, 5), "row-parallel columns: size 12 is not divisible by 5 shards"),
        (ROW, [(8,)], FULL, "row-parallel weight must be 2-D"),
        (GATE_UP, [(8, 5), (8, 5)], Shard(0, 3), "gate/up rows: size 8 is not divisible by 3 shards"),
        (GATE_UP, [(8, 5), (6, 5)], FULL, "gate/up shapes [8, 5]/[6, 5] differ"),
    ],
)
def test_validation_runs_on_shapes_alone(t, shapes_in, s, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")):
        t.blocks(shapes_in, s, SHAPES)
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace("]", r"\]")):
        t.shard([torch.zeros(x) for x in shapes_in], s, SHAPES)


IMPORT_CHECK = """
import builtins, sys, traceback
real, chain = builtins.__import__, []

def spy(name, *args, **kw):
    if name.split(".")[0] == "torch" and "torch" not in sys.modules and not chain:
        chain.extend(f"{f.filename}:{f.lineno}" for f in traceback.extract_stack() if "megatron_bridge" in f.filename)
    return real(name, *args, **kw)

builtins.__import__ = spy
import megatron_bridge.bridge.shards, megatron_bridge.bridge.mapping, megatron_bridge.bridge.stacked
import megatron_bridge.bridge.table, megatron_bridge.bridge.loader
import megatron_bridge.bridge.hf_config
import megatron_bridge.bridge.registry, megatron_bridge.bridge.layout, megatron_bridge.convert.sources.rows
megatron_bridge.bridge.registry.families()
assert "torch" not in sys.modules, "torch imported via " + " -> ".join(chain)
"""


def test_tables_and_validation_import_without_torch():
    """The converter validates and plans a checkpoint before (or without) `import torch`."""
    r = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
