"""The offline torch_dist writer (`mbr convert`) names every tensor as megatron-core's own
`sharded_state_dict()` of the built model does, for every bridged family — our modules
included (post-sublayer norms, sinks, MLA's plain norm names and linears' extra state). The
oracle is the model megatron builds (one process, tp1); `train.init_from` loads by these keys."""

from __future__ import annotations

import pytest

from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.runtime.tiny import tiny_config


@pytest.mark.parametrize("family", list(TINY))
def test_writer_keys_are_megatrons(family, groups1):
    from megatron_bridge.backends.native.checkpoint import extra_state_location, location
    from megatron_bridge.bridge.hf_config import spec_from_hf
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model

    spec = spec_from_hf(tiny_config(family).to_dict())
    (chunk,) = build_model(spec, Layout())
    want = {v.key for v in chunk.sharded_state_dict().values()}
    names = [n for n in chunk.state_dict() if not n.endswith("_extra_state")]
    got = {location(n, spec).key for n in names}
    got |= {loc.key for n in names if (loc := extra_state_location(n, spec)) is not None}
    assert got == want, (sorted(got - want)[:6], sorted(want - got)[:6])


@pytest.mark.parametrize(
    "family,divisor",
    [("llama", None), ("llama", 2), ("qwen2_moe", 2), ("deepseek_v3", None), ("gpt_oss", 2)],
    ids=["llama", "llama-250-rows", "qwen2_moe-250-rows", "deepseek_v3", "gpt_oss-250-rows"],
)
def test_init_from_reads_what_megatron_core_loads(family, divisor, groups1, tmp_path):
    """`train.init_from` reads a torch_dist checkpoint with the converter's reader
    (`runtime.load_converted.dist_state`); megatron-core's `dist_checkpointing.load` of the
    same `sharded_state_dict()` is the oracle: the same keys and every value bit for bit —
    SwiGLU's split fc1, experts, MLA, and an embedding stored with 250 rows read into the
    model's 256 (the rest zeros, megatron's `allow_shape_mismatch`)."""
    import argparse

    import torch
    from megatron.core import dist_checkpointing

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.cli import main as mbr
    from megatron_bridge.convert.formats.dist_read import DistReader
    from megatron_bridge.convert.formats.safetensors_io import PositionedReader
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.native.converted import dist_state
    from megatron_bridge.runtime.tiny import make_tiny

    hf = make_tiny(family, tmp_path / "hf")
    pad = [f"model.make_vocab_size_divisible_by={divisor}"] if divisor else []
    assert mbr(["convert", f"src={hf}", f"dst={tmp_path / 'out'}", "progress=off", *pad]) == 0
    ckpt = tmp_path / "out" / "release"
    spec = load_spec(hf)
    ours_chunk, theirs_chunk = (build_model(spec, Layout(), load_weights=True)[0] for _ in range(2))
    ours = dist_state(ours_chunk, DistReader(ckpt, PositionedReader()))
    with torch.serialization.safe_globals([argparse.Namespace]):
        theirs = dist_checkpointing.load({"m": theirs_chunk.sharded_state_dict()}, str(ckpt))["m"]
    assert set(ours) == set(theirs)
    for k, want in theirs.items():
        got = ours[k]
        assert torch.equal(got, want) if torch.is_tensor(want) else got == want, k
    if divisor:
        emb = ours["embedding.word_embeddings.weight"]
        assert emb.shape[0] == 256 and not emb[250:].any() and emb[:250].abs().sum() > 0
