"""Context-parallel attention helpers: megatron's load-balanced chunking and the masks.

The attention module itself is exercised end to end (logits and gradients equal to the
transformers oracle at cp2 / cp2·tp2, GQA/MQA and sliding windows) in
tests/dist/test_bridge_parity.py; here the position bookkeeping it relies on.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_bridge.runtime.cp_attention import allowed_mask, cp_positions, merge_from_cp, split_for_cp


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_split_matches_positions_and_merge_inverts(cp):
    s = 16
    seq = torch.arange(s).unsqueeze(0)
    parts = [split_for_cp(seq, cp, r) for r in range(cp)]
    for r, p in enumerate(parts):
        assert torch.equal(p[0], cp_positions(s // cp, cp, r))
    assert torch.equal(merge_from_cp(parts), seq)
    if cp == 2:  # chunks 0,3 on rank 0 and 1,2 on rank 1
        assert parts[0][0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_sharded_attention_with_global_positions_equals_full(window):
    """Each CP rank's queries against all (rank-ordered) keys with the position mask give
    exactly the rows of full causal (windowed) attention."""
    torch.manual_seed(0)
    s, cp, d = 16, 2, 8
    q, k, v = (torch.randn(1, 2, s, d) for _ in range(3))
    full_mask = allowed_mask(torch.arange(s), torch.arange(s), True, window)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask)
    k_pos = torch.cat([cp_positions(s // cp, cp, r) for r in range(cp)])
    k_all = torch.cat([split_for_cp(k, cp, r, seq_dim=2) for r in range(cp)], dim=2)
    v_all = torch.cat([split_for_cp(v, cp, r, seq_dim=2) for r in range(cp)], dim=2)
    outs = []
    for r in range(cp):
        q_pos = cp_positions(s // cp, cp, r)
        m = allowed_mask(q_pos, k_pos, True, window)
        outs.append(F.scaled_dot_product_attention(split_for_cp(q, cp, r, seq_dim=2), k_all, v_all, attn_mask=m))
    torch.testing.assert_close(merge_from_cp(outs, seq_dim=2), ref, rtol=0, atol=1e-6)


def test_window_matches_transformers_semantics():
    """HF: key j visible to query i iff 0 <= i - j < W; megatron window_size = (W-1, 0)."""
    W = 4
    m = allowed_mask(torch.arange(10), torch.arange(10), True, (W - 1, 0))
    i, j = torch.meshgrid(torch.arange(10), torch.arange(10), indexing="ij")
    assert torch.equal(m, (i - j >= 0) & (i - j < W))
