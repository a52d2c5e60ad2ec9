"""Megatron-LM's per-rank file names (the layer split itself: tests/unit/parallel/test_stage_split.py)."""

from __future__ import annotations

import pytest

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.convert.placement.rank_files import RankFile


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
