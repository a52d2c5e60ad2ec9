"""Sparse-attention layer kinds on the transformers backend (DeepSeek-V3.2, GLM-5, ...), without building a
model: the indexer stays whole next to the split MLA projections, the layouts and kinds the stages
cannot run are refused naming the piece, and every buildable kind has its mask function. The
forward itself is checked against transformers by the hf parity launch (deepseek_v32 in its
matrix sample) and `mbr verify --matrix model.backend=transformers` (docs/bridge.md)."""

from __future__ import annotations

import pytest

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.transformers.backend import meta
from megatron_bridge.backends.transformers.plan import (
    COLUMN,
    HEAD,
    LAYER_KINDS,
    REPLICATED,
    cp_refusals,
    layer_limits,
    plan_of,
    tensor_kinds,
)
from megatron_bridge.bridge.hf_config import UnsupportedFeatures
from megatron_bridge.parallel.dims import ParallelDims


def _tiny(model_type: str) -> dict:
    from megatron_bridge.runtime.hf_tiny import tiny_config

    return {**tiny_config(model_type).to_dict(), "model_type": model_type}


def test_the_indexer_stays_whole_beside_the_split_mla_projections():
    k = meta(describe_hf(_tiny("deepseek_v32"), make_vocab_size_divisible_by=8, backend="transformers")).kinds
    a = "model.layers.1.self_attn"
    indexer = {n: kind for n, kind in k.items() if n.startswith(f"{a}.indexer.")}
    assert len(indexer) == 5 and set(indexer.values()) == {REPLICATED}, indexer  # wq_b, wk, k_norm (w, b), weights_proj
    assert k[f"{a}.q_b_proj.weight"] == k[f"{a}.kv_b_proj.weight"] == COLUMN


def test_an_indexer_tensor_shaped_like_a_per_head_one_is_not_split_by_head():
    """The unplanned-per-head rule would split a [heads]-long vector next to a split q_b_proj;
    inside an indexer it must not (its top-k is shared by all heads, computed whole)."""
    plan = plan_of("deepseek_v32", "model", {"layers.*.self_attn.q_b_proj": "colwise"}, None, ["lm_head"])
    a = "model.layers.0.self_attn"
    shapes = {f"{a}.q_b_proj.weight": (160, 8), f"{a}.norm_like.weight": (4,), f"{a}.indexer.k_norm.weight": (4,)}
    k = tensor_kinds(plan, shapes, heads=4, kv_heads=4, head_dim=40)
    assert k[f"{a}.norm_like.weight"] == HEAD
    assert k[f"{a}.indexer.k_norm.weight"] == REPLICATED


def test_indexed_layers_under_context_parallelism_are_refused_naming_the_kind():
    hf = _tiny("deepseek_v32")
    (problem, fix), *rest = cp_refusals(hf["layer_types"], 2)
    assert "layer kind 'indexed_attention' (layers 0, 1, 2, 3) cannot run under context parallelism (cp=2)" in problem
    assert "its indexer scores every query against all keys" in problem and fix == "set cp=1" and not rest
    assert not layer_limits(hf, ParallelDims(pp=2, tp=2))


def test_a_stage_may_not_start_at_a_layer_reusing_the_previous_layers_top_k():
    """GLM-5's 'shared' indexer layers take the previous layer's top-k, which megatron's
    schedules cannot pass between stages: even splits start at 'full' layers, 1+3 does not."""
    hf = _tiny("glm_moe_dsa")
    assert hf["indexer_types"] == ["full", "shared", "full", "shared"]
    assert layer_limits(hf, ParallelDims(pp=2)) == []
    (problem, _), *rest = layer_limits(hf, ParallelDims(pp=2, layers_first_stage=1))
    assert "layer 1 (indexer_types[1]='shared') takes prev_topk_indices from layer 0" in problem and not rest


@pytest.mark.parametrize(
    "model_type, needle",
    [
        ("inkling_text", "conv_mask (create_recurrent_attention_mask)"),
    ],
)
def test_sparse_kinds_not_built_are_refused_naming_the_missing_piece(model_type, needle):
    with pytest.raises(UnsupportedFeatures) as e:
        describe_hf(_tiny(model_type), backend="transformers")
    assert needle in str(e.value) and "the transformers backend builds" not in str(e.value)


def test_every_buildable_layer_kind_has_the_mask_its_model_builds():
    from megatron_bridge.runtime.transformers.chunk import MASKS

    assert set(MASKS) == set(LAYER_KINDS)
