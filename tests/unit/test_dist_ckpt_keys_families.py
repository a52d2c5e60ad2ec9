"""The offline torch_dist writer (`mbr convert`) names every tensor as megatron-core's own
`sharded_state_dict()` of the built model does, for every bridged family — our modules
included (post-sublayer norms, sinks, MLA's plain norm names and linears' extra state). The
oracle is the model megatron builds (one process, tp1); `train.init_from` loads by these keys."""

from __future__ import annotations

import os

import pytest

from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.runtime.tiny import tiny_config


@pytest.fixture(scope="module")
def groups1():
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.runtime import groups
    from megatron_bridge.testing import free_port

    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    groups.initialize(ParallelDims(world_size=1, gpus_per_node=1), seed=0)
    yield
    groups.destroy()
    os.environ.clear()
    os.environ.update(env)


@pytest.mark.parametrize("family", list(TINY))
def test_writer_keys_are_megatrons(family, groups1):
    from megatron_bridge.bridge.hf_config import spec_from_hf
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.convert.formats.dist_ckpt import extra_state_location, location
    from megatron_bridge.runtime.build import build_model

    spec = spec_from_hf(tiny_config(family).to_dict())
    (chunk,) = build_model(spec, Layout())
    want = {v.key for v in chunk.sharded_state_dict().values()}
    names = [n for n in chunk.state_dict() if not n.endswith("_extra_state")]
    got = {location(n, spec).key for n in names}
    got |= {loc.key for n in names if (loc := extra_state_location(n, spec)) is not None}
    assert got == want, (sorted(got - want)[:6], sorted(want - got)[:6])
