"""Gemma 4 on the transformers backend in one process: two `HFChunk` stages (no TP) joined by the packed
tensor megatron's schedule would pass reproduce transformers' hidden states and gradients, with
per-layer inputs computed on the first stage and sent behind the hidden states, and KV sharing
within the second stage (runtime/transformers/per_layer.py, kinds.SHARED_STATE); a stage split that
separates a KV-sharing pair is refused naming both layers. The TP/PP runs against transformers
are `mbr verify --matrix model.backend=transformers 'verify.families=[gemma4_text,gemma4_unified_text]'`."""

from __future__ import annotations

import copy

import pytest
import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.transformers.backend import TransformersBackend, model_plan
from megatron_bridge.backends.transformers.kinds import builds_windows, kv_share_sources, layer_kinds
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.runtime.hf_tiny import build_tiny, tiny_config
from megatron_bridge.runtime.transformers.chunk import HFChunk
from megatron_bridge.runtime.transformers.per_layer import PerLayerInputs, extra_width, per_layer_modules


def _chunk(model, layers: range, pre: bool) -> HFChunk:
    base, plan = model.model, model_plan(model)
    modules = {plan.embed: base.embed_tokens} if pre else {}
    kept = {n: getattr(base, n) for n in per_layer_modules(model.config)} if pre else {}
    modules.update({f"model.{n}": m for n, m in kept.items()})
    tc = TransformerConfig(num_layers=4, hidden_size=model.config.hidden_size, num_attention_heads=4)
    return HFChunk(
        tc,
        model.config,
        plan,
        modules,
        {i: base.layers[i] for i in layers},
        ("model.rotary_emb", base.rotary_emb),
        pre_process=pre,
        post_process=False,
        vocab_size=model.config.vocab_size,
        tied=False,
        forward_math={},
        per_layer=PerLayerInputs(base, kept),
        kinds=dict(enumerate(layer_kinds(model.config, len(base.layers), builds_windows(type(base))))),
    )


def test_two_stages_with_per_layer_inputs_and_kv_sharing_are_transformers(monkeypatch):
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: 1)
    ref = build_tiny("gemma4_text")  # 4 layers, layer 3 reads the keys and values layer 2 stores
    ref.config._attn_implementation = "eager"
    assert ref.config.kv_sharing_modes == [None, "store", "store", "reuse"] and ref.config.hidden_size_per_layer_input
    ids = torch.randint(1, ref.config.vocab_size, (2, 12))
    before_norm = {}
    ref.model.norm.register_forward_hook(lambda m, args, out: before_norm.setdefault("h", args[0]))
    ref.model(input_ids=ids)
    before_norm["h"].pow(2).sum().backward()

    ours = copy.deepcopy(ref)
    ours.zero_grad()
    first, second = _chunk(ours, range(0, 2), pre=True), _chunk(ours, range(2, 4), pre=False)
    sent = first(ids)  # [s, b, h + L*d_pl]: what megatron's p2p would carry
    assert sent.shape == (12, 2, ref.config.hidden_size + extra_width(ref.config))
    second.set_input_tensor(sent)
    h, _ = second.per_layer.unpack(second(ids))
    assert (h - before_norm["h"]).abs().max() < 1e-5
    h.pow(2).sum().backward()
    theirs = dict(ref.named_parameters())
    got = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert "model.embed_tokens_per_layer.weight" in got and "model.layers.3.self_attn.q_proj.weight" in got
    for n, g in got.items():
        assert (g - theirs[n].grad).abs().max() <= 1e-4 * theirs[n].grad.abs().max() + 1e-6, n


def test_a_stage_split_that_separates_a_kv_sharing_pair_is_refused_naming_both_layers():
    kinds = ["sliding_attention", "full_attention"] * 2
    cfg = CONFIG_MAPPING["gemma4_unified_text"](num_hidden_layers=4, num_kv_shared_layers=2, layer_types=kinds)
    hf = {**cfg.to_dict(), "model_type": "gemma4_unified_text"}
    assert kv_share_sources(hf) == {2: 0, 3: 1}  # the last 2 layers read the last earlier layer of their kind
    spec = describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")
    (problem, fix), *rest = TransformersBackend().layout_limits(spec, ParallelDims(pp=2))
    assert "layer 2 reuses the keys and values layer 0 stores" in problem and len(rest) == 1
    assert "keeps layers 0..2 on one stage" in fix
    assert not TransformersBackend().layout_limits(spec, ParallelDims(tp=2))
    tiny = {**tiny_config("gemma4_unified_text").to_dict(), "model_type": "gemma4_unified_text"}
    assert kv_share_sources(tiny) == {3: 2}
    assert not TransformersBackend().layout_limits(
        describe_hf(tiny, backend="transformers"), ParallelDims(pp=2)
    )  # 0 1 | 2 3


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4_unified_text"])
def test_gemma4_is_described_by_the_hf_backend(model_type):
    spec = describe_hf(
        {**CONFIG_MAPPING[model_type](num_hidden_layers=4).to_dict(), "model_type": model_type},
        make_vocab_size_divisible_by=8,
        backend="transformers",
    )
    assert spec.backend == "transformers"
