"""The converter's pipeline split equals megatron-core's, without importing megatron-core.

`convert.formats.placement.stage_layers` is megatron's `get_transformer_layer_offset` /
`get_num_layers_to_build` as arithmetic (the converter stays free of the 6 s megatron
import); here it is held equal to the bridge's megatron-backed `layout.stage_layers` for
every valid layout of a grid: even splits, virtual stages, uneven first/last stages.
"""

from __future__ import annotations

import pytest

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.convert.formats.placement import RankFile, stage_layers


def _valid(n, pp, vpp, first, last) -> bool:
    fixed = [x for x in (first, last) if x is not None]
    v = vpp or 1
    if not fixed:
        return n % (pp * v) == 0
    rest, stages = n - sum(fixed), pp - len(fixed)
    return (
        pp >= 1 + len(fixed)
        and stages >= 1
        and rest % (stages * v) == 0
        and rest >= stages * v
        and all(x % v == 0 for x in fixed)
    )


def test_stage_layers_match_megatron_core():
    from megatron_bridge.bridge.layout import stage_layers as megatron_stage_layers
    from megatron_bridge.bridge.spec import BridgeSpec
    from megatron_bridge.runtime.tconfig import transformer_config

    spec = BridgeSpec(
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
    checked = 0
    for n in (4, 6, 8, 12, 16):
        for pp in (1, 2, 3, 4):
            for vpp in (None, 2, 3):
                for first, last in ((None, None), (1, None), (None, 1), (2, 2), (2, None), (1, 3), (4, 4)):
                    if pp == 1 and (vpp or first or last) or not _valid(n, pp, vpp if pp > 1 else None, first, last):
                        continue
                    layout = Layout(pp=pp, vpp=vpp, layers_first_stage=first, layers_last_stage=last)
                    cfg = transformer_config(spec.replace(num_layers=n), layout)
                    covered = []
                    for p in range(pp):
                        for v in range(layout.vpp) if layout.vpp else [None]:
                            got = stage_layers(n, layout, p, v)
                            assert got == megatron_stage_layers(cfg, p, v), (n, pp, vpp, first, last, p, v)
                            covered += list(got)
                            checked += 1
                    assert sorted(covered) == list(range(n))
    assert checked > 100


@pytest.mark.parametrize(
    "tp,pp,ep,path",
    [
        (0, 0, 0, "release/mp_rank_00/model_optim_rng.pt"),
        (1, 2, 0, "release/mp_rank_01_002/model_optim_rng.pt"),
        (1, 0, 3, "release/mp_rank_01_003/model_optim_rng.pt"),
    ],
)
def test_rank_file_names_follow_megatron_lm(tp, pp, ep, path):
    layout = Layout(tp=2, pp=3 if pp else 1, ep=4 if ep else 1)
    assert RankFile(tp, pp, ep).relpath(layout) == path
