"""The one pipeline split, `ParallelDims.stage_layers`, equals megatron-core 0.16's own
(`get_transformer_layer_offset` / `get_num_layers_to_build` on the run's TransformerConfig)
for every layout the layout rules accept over a grid of layer counts, pp, vpp and uneven
first/last stages. The builder, the HF loader, the converter and the planner all take the
split from it, so an offline conversion places each layer where the live model builds it.
"""

from __future__ import annotations

import itertools

import pytest

from megatron_bridge.parallel.dims import ParallelDims

SPLITS = (None, 1, 2, 3, 4, 6)


def _accepted(num_layers: int, d: ParallelDims) -> bool:
    """`mbr check`'s verdict on the layout (its layout rules, as convert and verify apply them)."""
    from megatron_bridge.backends.describe import describe
    from megatron_bridge.config.schema import Config
    from megatron_bridge.parallel.rules.registry import check_all

    cfg = Config()
    cfg.model.num_layers = num_layers
    return not check_all(d.with_world(d.smallest_world), describe(cfg.model), cfg, layout_only=True)[0]


def _grid():
    for n, pp, vpp, first, last in itertools.product(range(1, 17), (1, 2, 3, 4), (None, 2, 3, 4), SPLITS, SPLITS):
        d = ParallelDims(pp=pp, vpp=vpp, layers_first_stage=first, layers_last_stage=last)
        if _accepted(n, d):
            yield n, d


def _megatron_split(tconfig, pp_rank: int, vp_stage: int | None) -> range:
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(tconfig, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(tconfig, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + n)


def test_no_middle_stage_with_vpp_is_refused():
    """pp=2 with both end stages fixed and vpp: megatron-core 0.16's offset divides by the
    (zero) number of middle stages, so it cannot build the model: `layers-uneven` refuses it."""
    from megatron_bridge.runtime.tconfig import transformer_config

    d = ParallelDims(pp=2, vpp=2, layers_first_stage=2, layers_last_stage=2)
    assert not _accepted(4, d) and _accepted(4, ParallelDims(pp=2, layers_first_stage=2, layers_last_stage=2))
    spec = _spec().replace(num_layers=4)
    with pytest.raises(ZeroDivisionError):
        _megatron_split(transformer_config(spec, d), 1, 0)


def _spec():
    from megatron_bridge.bridge.spec import BridgeSpec

    return BridgeSpec(
        family="llama",
        architecture="LlamaForCausalLM",
        num_layers=4,
        hidden_size=32,
        ffn_hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        vocab_size=256,
    )


def test_the_split_is_megatron_cores_for_every_accepted_layout():
    from megatron_bridge.runtime.tconfig import transformer_config

    spec = _spec()
    checked, kinds = 0, set()
    for n, d in _grid():
        tconfig = transformer_config(spec.replace(num_layers=n), d)
        chunks = range(d.vpp) if d.vpp else [None]
        covered = []
        for pp_rank in range(d.pp):
            for vp in chunks:
                ours = d.stage_layers(n, pp_rank, vp)
                assert ours == _megatron_split(tconfig, pp_rank, vp), (n, d.degrees(), pp_rank, vp)
                covered += ours
                checked += 1
            assert d.stage_layer_ids(n, pp_rank) == tuple(i for vp in chunks for i in d.stage_layers(n, pp_rank, vp))
        assert sorted(covered) == list(range(n)), (n, d.degrees())
        kinds.add((d.pp > 1, d.vpp is not None, d.layers_first_stage is not None, d.layers_last_stage is not None))
    assert checked > 1000
    assert {k[1:] for k in kinds if k[0]} == set(itertools.product((False, True), repeat=3))  # pp>1: every mix


def test_the_split_in_examples():
    d = ParallelDims(pp=2, vpp=2)
    assert [list(d.stage_layers(8, p, v)) for v in range(2) for p in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert d.stage_layer_ids(8, 1) == (2, 3, 6, 7)
    uneven = ParallelDims(pp=3, layers_first_stage=1, layers_last_stage=1)
    assert [list(uneven.stage_layers(4, p)) for p in range(3)] == [[0], [1, 2], [3]]
    assert ParallelDims().stage_layers(5, 0) == range(5)
    assert ParallelDims(pp=4, vpp=2, layers_first_stage=2, layers_last_stage=4).stage_layer_ids(14, 3) == (5, 6, 12, 13)
