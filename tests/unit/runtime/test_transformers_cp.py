"""runtime/transformers/cp.py in one process (a CP group of one, so the K/V gather is the identity): the
registered `mbr_cp_*` attention and the masks it is given reproduce transformers' own attention
and masks for full and sliding layers, eager (additive mask, soft-capping) and SDPA (boolean);
a forward whose layers bypass the interface is refused. The cp2 arithmetic itself is checked
against transformers in tests/dist/test_transformers_backend_parity.py."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state as ps
from transformers import Gemma2Config
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gemma2.modeling_gemma2 import Gemma2Attention, Gemma2RotaryEmbedding

from megatron_bridge.errors import UserError
from megatron_bridge.runtime.transformers import cp


@pytest.fixture()
def one_rank_cp(tmp_path, monkeypatch):
    mine = not torch.distributed.is_initialized()
    if mine:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    monkeypatch.setattr(ps, "get_context_parallel_group", lambda: torch.distributed.group.WORLD)
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 1)
    yield
    if mine:  # later tests may expect no process group
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("layer", [0, 1])  # Gemma-2: sliding, then full attention
def test_cp_attention_and_masks_are_transformers(one_rank_cp, impl, layer):
    torch.manual_seed(0)
    kw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5)
    if impl == "sdpa":
        kw["attn_logit_softcapping"] = None  # SDPA has no soft-capping
    cfg = Gemma2Config(**kw, num_hidden_layers=2, vocab_size=16, attn_implementation=impl)
    att = Gemma2Attention(cfg, layer).eval()
    x, pos = torch.randn(1, 12, 32), torch.arange(12)[None]
    emb = Gemma2RotaryEmbedding(cfg)(x, pos)
    kind = cfg.layer_types[layer]
    make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}[kind]
    ref = att(x, emb, make(config=cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=pos))
    cfg._attn_implementation = cp.cp_implementation(impl)
    before = cp.calls()
    got = att(x, emb, cp.CP_MASKS[kind](config=cfg, inputs_embeds=x, position_ids=pos))
    cp.check_attended(before, 1)
    assert (got[0] - ref[0]).abs().max() < 1e-6
    with pytest.raises(UserError, match="1 of 1 decoder layers did not call"):
        cp.check_attended(cp.calls(), 1)  # a layer whose attention bypassed the interface
