"""Hyper-connection streams on the transformers backend (overrides.Override.streams; HY-V4, DeepSeek-V4,
Qwen4-Exp) in one process: two chunks cut from the same meta model (layers 0-1 with the embedding,
layers 2-3 with the fold module, the norm and the head) hand each other the [s, b, n·h] activation a
pipeline stage sends, and give transformers' logits; DeepSeek-V4's extra layer inputs (the {'main',
'compress'} rotary pair, input_ids for its hash-routed MoE) reach the second chunk too, as do
Qwen4-Exp's (its streams side by side in the hidden dim, folded by hyper_connection_mixer with no
final norm; ple_input_ids for the n-gram embeddings of layer 0, on the first chunk, and conv_mask).
The multi-process layouts (tp2, pp2, tp2·pp2, ep2) are `mbr verify --matrix model.backend=transformers` rows
(docs/bridge.md)."""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state as ps

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.transformers.backend import meta, model_plan
from megatron_bridge.backends.transformers.plan import override
from megatron_bridge.parallel.dims import ParallelDims


@pytest.fixture()
def one_rank(tmp_path):
    mine = not torch.distributed.is_initialized()
    if mine:
        torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    ps.initialize_model_parallel()
    yield
    ps.destroy_model_parallel()
    if mine:  # later tests may expect no process group
        torch.distributed.destroy_process_group()


POST = {
    "hy_v4": ("model.hc_head", "model.norm"),
    "deepseek_v4": ("model.hc_head", "model.norm"),
    "qwen4_exp_text": ("model.hyper_connection_mixer",),
}


@pytest.mark.parametrize("model_type", sorted(POST))
def test_two_stages_pass_the_streams_folded_and_give_transformers_logits(one_rank, model_type):
    from megatron_bridge.runtime.hf_tiny import build_tiny
    from megatron_bridge.runtime.transformers.build import Stage, transformer_config

    ref = build_tiny(model_type).eval()
    cfg = ref.config
    spec = describe_hf(
        {**cfg.to_dict(), "model_type": model_type}, make_vocab_size_divisible_by=1, backend="transformers"
    )
    ov = override(model_type)
    n, h = ov.stream_count(cfg), cfg.hidden_size
    assert n == getattr(cfg, ov.streams[0]) > 1 and model_plan(ref).post == POST[model_type]
    with torch.device("meta"):
        full = type(ref)(cfg)
    tconfig = transformer_config(spec, ParallelDims())
    stage = Stage(spec, full, model_plan(full), meta(spec).kinds, tconfig, torch.device("cpu"), False)
    half = cfg.num_hidden_layers // 2
    first, last = stage.chunk(range(half), True, False), stage.chunk(range(half, cfg.num_hidden_layers), False, True)
    weights = ref.state_dict()
    with torch.no_grad():
        for chunk in (first, last):
            for name, t in chunk.state_dict().items():
                if isinstance(t, torch.Tensor):  # megatron layers' `_extra_state` entries are None
                    t.copy_(weights[name])
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    # one row of positions per sample, as the trainer's batches have (Qwen4-Exp's indexer reads them so)
    pos = torch.arange(16).expand(2, -1)
    with torch.no_grad():
        sent = first.eval()(ids, pos)
        assert sent.shape == (
            16,
            2,
            n * h,
        )  # what megatron's p2p carries: hidden_size n·h (runtime/transformers/build.py)
        last.eval().set_input_tensor(sent)
        got = last(ids, pos)
        want = ref(ids).logits
    assert (got - want).abs().max() < 1e-5
