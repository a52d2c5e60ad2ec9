"""The rank grid must be megatron-core's, exactly: compare with its own RankGenerator.

megatron-core's `RankGenerator` is pure Python (no process group), so every layout can be
compared in-process; tests/dist/test_groups.py then checks the real groups under torchrun.
"""

import time

import numpy as np
import pytest
from megatron.core.parallel_state import RankGenerator

from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.topology import GROUPS, Topology

LAYOUTS = [  # (world, gpus_per_node, tp, pp, cp, ep, etp)
    (8, 8, 2, 2, 1, 1, 2),
    (8, 8, 2, 1, 2, 1, 2),
    (8, 8, 1, 1, 1, 2, 1),
    (16, 4, 2, 2, 2, 1, 2),
    (32, 8, 2, 2, 1, 4, 1),
    (64, 8, 4, 2, 2, 2, 2),
    (48, 8, 2, 3, 1, 2, 1),
]

# our group name -> (megatron generator, token)
MEGATRON_TOKEN = {
    "tp": ("dense", "tp"),
    "cp": ("dense", "cp"),
    "dp": ("dense", "dp"),
    "pp": ("dense", "pp"),
    "dp_cp": ("dense", "dp-cp"),
    "tp_cp": ("dense", "tp-cp"),
    "mp": ("dense", "tp-pp"),
    "ep": ("expert", "ep"),
    "etp": ("expert", "tp"),
    "edp": ("expert", "dp"),
}


def dims_for(world, gpn, tp, pp, cp, ep, etp):
    return ParallelDims(
        world_size=world, gpus_per_node=gpn, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=world // (tp * pp * cp)
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: "w{}-n{}-tp{}-pp{}-cp{}-ep{}-etp{}".format(*lay))
def test_groups_equal_megatron_rank_generator(layout):
    d = dims_for(*layout)
    gens = {
        "dense": RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=d.cp, order="tp-cp-ep-dp-pp"),
        "expert": RankGenerator(tp=d.etp, ep=d.ep, dp=d.expert_dp, pp=d.pp, cp=1, order="tp-cp-ep-dp-pp"),
    }
    topo = Topology(d)
    assert set(GROUPS) == set(MEGATRON_TOKEN)
    for name, (gen, token) in MEGATRON_TOKEN.items():
        assert topo.groups(name).tolist() == gens[gen].get_ranks(token), name


def test_coordinates_consistent_with_groups():
    d = dims_for(64, 8, 4, 2, 2, 2, 2)
    topo, c = Topology(d), Topology(d).coords
    for name, axis in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("ep", "ep")):
        for g in topo.groups(name):
            assert c[axis][g].tolist() == list(range(len(g))), name  # members enumerate the axis


def test_node_placement():
    d = dims_for(64, 8, 8, 4, 1, 1, 8)  # dp = 2
    topo = Topology(d)
    assert topo.intra_node("tp") and not topo.intra_node("pp") and not topo.intra_node("dp")
    assert topo.group_of("tp", 13) == list(range(8, 16))
    assert topo.group_of("dp", 3) == [3, 11]
    assert topo.group_of("pp", 3) == [3, 19, 35, 51]
    assert Topology(dims_for(8, 8, 2, 2, 1, 1, 2)).intra_node("pp")  # one node: everything inside


def test_rank_map_16384_ranks_fast():
    d = dims_for(16384, 8, 8, 16, 1, 1, 8)
    t0 = time.process_time()  # CPU time of this process: robust to a busy machine
    text = Topology(d).format_rank_map()
    spans = Topology(d).span_summary(moe=False)
    elapsed = time.process_time() - t0
    assert elapsed < 1.0, elapsed
    assert "node 2047:" in text and "16383" in text
    assert spans["tp"] == "intra-node" and spans["pp"] == "inter-node"
    # TP innermost: rank 16383 is the last tp rank of the last dp replica of the last stage.
    c = Topology(d).coords
    assert (int(c["tp"][16383]), int(c["dp"][16383]), int(c["pp"][16383])) == (7, 127, 15)
    assert np.array_equal(c["node"][:16], [0] * 8 + [1] * 8)
