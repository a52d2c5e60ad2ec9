"""megatron-core's real process groups (8 processes, gloo) equal our `Topology` rank grid, and
the DeepSpeed mpu returned by `groups.initialize` reports the same groups, ranks and sizes.

All layouts run in ONE torchrun launch (startup of 8 processes dominates)."""

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.topology import GROUPS, Topology

pytestmark = pytest.mark.dist

WORLD = 8
LAYOUTS = {
    # overrides -> (tp, pp, cp, ep, etp, dp) the layout must resolve to
    "recipe=tiny_llama parallel.tp=2 parallel.pp=2": (2, 2, 1, 1, 2, 2),
    "recipe=tiny_llama parallel.tp=2 parallel.pp=1 parallel.cp=2": (2, 1, 2, 1, 2, 2),
    "recipe=tiny_mixtral parallel.pp=2 train.global_batch_size=16": (1, 2, 1, 2, 1, 4),  # ep2·dp4, edp2
    "recipe=tiny_mixtral parallel.tp=2 parallel.etp=1 parallel.sequence_parallel=true": (
        2,
        1,
        1,
        2,
        1,
        4,
    ),  # ep2·dp4 with tp2, edp4
}
MPU_KINDS = ("mp", "tp", "pp", "dp", "cp", "dp_cp", "ep")


def _topology(overrides: str) -> Topology:
    cfg, _ = compose(overrides.split() + [f"cluster.gpus_per_node={WORLD}"])
    return Topology(ParallelDims.from_config(cfg, WORLD, moe=describe(cfg.model).is_moe))


@pytest.fixture(scope="module")
def results(torchrun):
    return torchrun(["tests/dist/scripts/check_groups.py", *LAYOUTS], WORLD, timeout=300)


def test_every_rank_reported_every_layout(results):
    assert [r["rank"] for r in results] == list(range(WORLD))
    for r in results:
        assert r["shim"] is True  # CPU host: the shim must be active
        assert set(r["layouts"]) == set(LAYOUTS)


def test_a_layout_switch_destroys_the_groups_it_made(results):
    """groups.release() (what the next layout's initialize calls) leaves only the default group
    and its one gloo transport thread: megatron's destroy_model_parallel alone forgot ~17 groups a
    layout, each with a thread waking every 10 ms (a fifth of the tests' CPU)."""
    for r in results:
        for overrides, entry in r["layouts"].items():
            assert entry["groups_made"] >= 5, (overrides, entry["groups_made"])
            assert entry["groups_left"] == 0, (r["rank"], overrides, entry["groups_left"])
            assert entry["gloo_loops_left"] == 1, (r["rank"], overrides, entry["gloo_loops_left"])


@pytest.mark.parametrize("overrides", list(LAYOUTS))
def test_megatron_groups_equal_topology(results, overrides):
    topo = _topology(overrides)
    tp, pp, cp, ep, etp, dp = LAYOUTS[overrides]
    for r in results:
        got = r["layouts"][overrides]
        assert got["dims"] == dict(tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp, world_size=WORLD)
        for name in GROUPS:
            expected = topo.group_of(name, r["rank"])
            assert got["megatron"][name] == expected, (overrides, name, r["rank"])
            # the group communicates over exactly those ranks
            assert got["allreduce"][name] == float(sum(expected)), (overrides, name, r["rank"])
    # and together the ranks' groups are exactly the topology's groups
    for name in GROUPS:
        seen = {tuple(r["layouts"][overrides]["megatron"][name]) for r in results}
        assert seen == {tuple(g) for g in topo.groups(name).tolist()}, (overrides, name)


@pytest.mark.parametrize("overrides", list(LAYOUTS))
def test_deepspeed_mpu_reports_the_same_groups(results, overrides):
    topo = _topology(overrides)
    for r in results:
        rank, got = r["rank"], r["layouts"][overrides]
        for kind in MPU_KINDS:
            expected = topo.group_of(kind, rank)
            mpu = got["mpu"][kind]
            assert mpu["ranks"] == expected, (overrides, kind, rank)
            assert mpu["size"] == len(expected)
            assert mpu["rank"] == expected.index(rank)
        assert got["mpu"]["dp_group_ranks"] == topo.group_of("dp", rank)
        # and DeepSpeed's own accessors (deepspeed.utils.groups / bwc), given this mpu, agree
        ds, dims = got["deepspeed"], got["dims"]
        dp, dp_cp = topo.group_of("dp", rank), topo.group_of("dp_cp", rank)
        assert ds["dp"] == ds["dp_ranks"] == dp and ds["dp_size"] == dims["dp"]
        assert ds["dp_rank"] == dp.index(rank)
        assert ds["mp_size"] == dims["tp"] * dims["pp"]
        assert ds["sp_size"] == dims["cp"] and ds["sdp"] == dp_cp
        assert ds["broadcast_src"] == dp_cp[0]
        assert ds["tp"] == topo.group_of("tp", rank) and ds["tp_size"] == dims["tp"]
        assert ds["tp_rank"] == topo.group_of("tp", rank).index(rank)
        assert ds["pp"] == topo.group_of("pp", rank) and ds["pp_size"] == dims["pp"]


@pytest.mark.parametrize("overrides", list(LAYOUTS))
def test_rng_trackers_follow_the_layout(results, overrides):
    """The CPU RNG tracker, seeded by `initialize`: the model-parallel stream differs exactly
    between different (tp, pp) coordinates, the default (data-parallel) stream between pipeline
    stages, and the expert-parallel stream between (pp, ep, etp) coordinates."""
    c = _topology(overrides).coords
    keys = {"model": ("tp", "pp"), "default": ("pp",), "expert": ("pp", "ep", "etp")}
    for r in results:
        assert r["layouts"][overrides]["rng"]["tracker"] == "CpuRNGStatesTracker"
    for stream, axes in keys.items():
        for a in results:
            for b in results:
                same = all(c[k][a["rank"]] == c[k][b["rank"]] for k in axes)
                equal = a["layouts"][overrides]["rng"][stream] == b["layouts"][overrides]["rng"][stream]
                assert equal == same, (overrides, stream, a["rank"], b["rank"])


def test_world_size_mismatch_is_a_user_error(monkeypatch):
    """Checked before any process group exists, with a message naming both numbers."""
    from megatron_bridge.errors import UserError
    from megatron_bridge.runtime import groups

    cfg, _ = compose(["recipe=tiny_llama", "cluster.gpus_per_node=8"])
    dims = ParallelDims.from_config(cfg, 8, moe=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UserError, match=r"started 4 processes \(WORLD_SIZE=4\).*world_size=8"):
        groups.initialize(dims)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(UserError, match="torchrun --nproc-per-node 8"):
        groups.initialize(dims)
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert groups.dims_from_env(cfg, describe(cfg.model), validate=False).world_size == 6
