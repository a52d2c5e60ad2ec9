"""Falcon on the transformers backend: its plan from the override table (backends/transformers/overrides.py OVERRIDES,
transformers ships none), per config layout, and its fused query_key_value split per TP rank
checked against transformers' own `_split_heads` in process (the numbers at tp2 / pp2: the
matrix and tests/dist/test_transformers_backend_parity.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.transformers.meta import model_plan
from megatron_bridge.backends.transformers.plan import MQA_QKV
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.hf_tiny import architectures, tiny_config
from megatron_bridge.runtime.transformers.layers import mqa_local

QKV = "transformer.h.*.self_attention.query_key_value"
# tiny architecture -> the style its query_key_value gets
VARIANTS = {"falcon": MQA_QKV, "falcon_new_decoder": "colwise", "falcon_rw": "colwise"}


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_falcon_plan_per_layout_and_the_matrix_lists_it(arch):
    assert arch in architectures()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(arch))
    plan = model_plan(model)
    assert (plan.embed, plan.layers, plan.post, plan.head) == (
        "transformer.word_embeddings",
        "transformer.h",
        ("transformer.ln_f",),
        "lm_head",
    )
    assert dict(plan.tp) == {
        QKV: VARIANTS[arch],
        "transformer.h.*.self_attention.dense": "rowwise",
        "transformer.h.*.mlp.dense_h_to_4h": "colwise",
        "transformer.h.*.mlp.dense_4h_to_h": "rowwise",
    }


def test_falcon_alibi_is_refused_by_name():
    hf = {**tiny_config("falcon_rw", alibi=True).to_dict(), "model_type": "falcon"}
    with pytest.raises(UserError, match="alibi=True: FalconModel.forward adds the ALiBi bias"):
        describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")


@pytest.mark.parametrize("arch", list(VARIANTS))
def test_each_rank_gets_its_heads_of_the_fused_query_key_value(arch):
    """Rank r's output of query_key_value (a row block of the weight: colwise; the whole output cut
    by `mqa_local`: multi-query), viewed by the attention with its heads divided as the builder
    divides them, gives exactly transformers' query/key/value heads of rank r."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    attn = model.transformer.h[0].self_attention
    heads, hd, tp = attn.num_heads, attn.head_dim, 2
    x = torch.randn(2, 5, model.config.hidden_size)
    fused = attn.query_key_value(x)
    q, k, v = (t.reshape(2, 5, -1, hd) for t in attn._split_heads(fused))
    for rank in range(tp):
        if VARIANTS[arch] == MQA_QKV:
            local, kv = mqa_local(fused, heads, hd, tp, rank), slice(None)  # one K/V head, every rank
            attn.num_heads = heads // tp
        else:
            local, kv = fused.chunk(tp, dim=-1)[rank], slice(rank * heads // tp, (rank + 1) * heads // tp)
            attn.num_heads, attn.num_kv_heads = heads // tp, attn.num_kv_heads // tp
        lq, lk, lv = (t.reshape(2, 5, -1, hd) for t in attn._split_heads(local))
        mine = slice(rank * heads // tp, (rank + 1) * heads // tp)
        assert torch.equal(lq, q[:, :, mine])
        assert torch.equal(lk, k[:, :, kv]) and torch.equal(lv, v[:, :, kv])
        attn.num_heads, attn.num_kv_heads = heads, model.transformer.h[1].self_attention.num_kv_heads
