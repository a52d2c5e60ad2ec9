"""GLM-4 and GLM-4.5 (families/glm.py) against transformers: the router, what the configs
turn on (and what absent keys default to), the q/k/v-only attention bias, the sandwich-norm
table, MTP layers skipped under GLM names, and one-process logits in which every GLM feature
is live (switching one off moves the logits away from transformers'). Multi-process layouts
are `mbr verify`'s."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge.hf_config import load_spec, spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import resolve_checkpoint
from megatron_bridge.bridge.registry import get_family
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.moe_routing import route
from megatron_bridge.runtime.tconfig import transformer_config
from megatron_bridge.runtime.tiny import tiny_config


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3},  # GLM-4.5's own grouping: none
        {"norm_topk_prob": False, "routed_scaling_factor": 1.0, "n_group": 2, "topk_group": 1},
    ],
)
def test_router_matches_transformers(overrides):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = tiny_config("glm4_moe", **overrides)
    router = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.3 * torch.randn(router.num_experts, generator=g))
    spec = spec_from_hf(cfg.to_dict())
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    _, w_ref, idx_ref = router(x)
    probs, routing_map = route(
        x @ router.weight.T,
        topk=spec.moe_router_topk,
        score_function=spec.moe_router_score_function,
        bias=router.e_score_correction_bias,
        num_groups=spec.moe_router_num_groups,
        group_topk=spec.moe_router_group_topk,
        renormalize=not spec.moe_router_pre_softmax,
        scaling=spec.moe_router_topk_scaling_factor,
    )
    ref = torch.zeros_like(probs).scatter(1, idx_ref, w_ref)
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, idx_ref, True))
    torch.testing.assert_close(probs, ref, rtol=0, atol=1e-6)


def test_specs_and_megatron_config():
    glm4 = spec_from_hf(tiny_config("glm4").to_dict())
    assert glm4.add_qkv_bias and not glm4.attention_out_bias and not glm4.mlp_bias
    assert (glm4.rotary_percent, glm4.rotary_interleaved, glm4.post_attention_norm, glm4.post_mlp_norm) == (
        0.5,
        True,
        True,
        True,
    )
    assert transformer_config(glm4, Layout(tp=2)).rotary_interleaved
    moe = spec_from_hf(tiny_config("glm4_moe").to_dict())
    assert moe.add_qkv_bias and not moe.attention_out_bias and moe.qk_layernorm and moe.qk_norm_type == "head"
    assert moe.rotary_percent == 0.5 and not moe.rotary_interleaved and not moe.post_attention_norm
    assert (moe.moe_router_score_function, moe.moe_router_expert_bias) == ("sigmoid", True)
    assert (moe.moe_router_num_groups, moe.moe_router_group_topk, moe.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert moe.moe_layer_pattern == (0, 1, 1, 1) and moe.moe_shared_expert_intermediate_size == 16
    assert not moe.moe_router_pre_softmax and not moe.moe_shared_expert_gate and moe.mtp_num_layers == 1
    tc = transformer_config(moe, Layout(tp=2, ep=2, sequence_parallel=True))
    assert not tc.rotary_interleaved and tc.qk_layernorm and not tc.moe_router_enable_expert_bias
    no_qk = spec_from_hf(tiny_config("glm4_moe", use_qk_norm=False).to_dict())
    assert not no_qk.qk_layernorm
    assert not any(
        "layernorm" in m.megatron and "self_attention" in m.megatron for m in get_family("glm4_moe").mappings(no_qk)
    )
    for s in (glm4, moe, no_qk, spec_from_hf(tiny_config("glm4", attention_bias=False).to_dict())):
        assert spec_from_hf(spec_to_hf_config(s)) == s


@pytest.mark.parametrize("family", ["glm4", "glm4_moe"])
def test_absent_keys_take_transformers_defaults(family):
    """A config.json without the keys the GLM config classes default (older files) reads as
    transformers reads it: the planner's count of the spec equals the model transformers builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_bridge.plan import params as P

    d = tiny_config(family).to_dict()
    for k in ("attention_bias", "partial_rotary_factor", "head_dim", "n_shared_experts", "first_k_dense_replace"):
        d.pop(k, None)
    for k in ("norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor"):
        d.pop(k, None)
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    spec = spec_from_hf(d)
    cfg = AutoConfig.for_model(**d)
    assert (
        spec.add_qkv_bias == cfg.attention_bias and spec.rotary_percent == cfg.rope_parameters["partial_rotary_factor"]
    )
    assert spec.head_dim == getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    if family == "glm4_moe":
        assert spec.moe_router_pre_softmax == (not cfg.norm_topk_prob) and spec.moe_layer_pattern == (0, 1, 1, 1)
        assert (spec.moe_router_num_groups, spec.moe_router_group_topk) == (cfg.n_group, cfg.topk_group)
        assert spec.moe_router_topk_scaling_factor is None and cfg.routed_scaling_factor == 1.0
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert P.count(spec).total == sum(p.numel() for p in model.parameters())


def test_attention_bias_is_qkv_only():
    """GLM's attention_bias: q/k/v biases, o_proj none (features/bias.py would read it as both
    and refuse it); the table has the qkv bias row and no linear_proj bias."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for family in ("glm4", "glm4_moe"):
        spec = spec_from_hf(tiny_config(family).to_dict())
        names = {m.megatron for m in get_family(family).mappings(spec)}
        assert "decoder.layers.{layer}.self_attention.linear_qkv.bias" in names
        assert not any("linear_proj.bias" in n for n in names)
        cfg = spec_to_hf_config(spec)
        assert cfg["attention_bias"] is True
        attn = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).model.layers[0].self_attn
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    with pytest.raises(UserError, match="attention_bias"):  # other families keep refusing an o_proj bias alone
        spec_from_hf(tiny_config("llama", attention_bias=True).to_dict())


def test_glm4_sandwich_norm_table_and_layer_specs():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    from megatron_bridge.runtime.layer_specs import all_layer_specs

    spec = spec_from_hf(tiny_config("glm4").to_dict())
    rows = {m.hf[0]: m.megatron for m in get_family("glm4").mappings(spec)}
    H, L = "model.layers.{layer}", "decoder.layers.{layer}"
    assert rows[f"{H}.post_self_attn_layernorm.weight"] == f"{L}.self_attention.post_layernorm.weight"
    assert rows[f"{H}.post_attention_layernorm.weight"] == f"{L}.pre_mlp_layernorm.weight"  # the norm before the MLP
    assert rows[f"{H}.post_mlp_layernorm.weight"] == f"{L}.mlp.post_layernorm.weight"
    assert rows[f"{H}.mlp.gate_up_proj.weight"] == f"{L}.mlp.linear_fc1.weight"
    for layer in all_layer_specs(spec, transformer_config(spec, Layout())):
        sub = layer.submodules
        assert issubclass(sub.self_attention.module, SelfAttention) and sub.self_attention.module is not SelfAttention
        assert issubclass(sub.mlp.module, MLP) and sub.mlp.module is not MLP


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("glm")
    return {fam: make_tiny(fam, root / fam) for fam in ("glm4", "glm4_moe")}


def test_mtp_layers_skipped_under_glm_names(tiny_dirs, capsys):
    from megatron_bridge.bridge.loader import HFCheckpoint

    path = tiny_dirs["glm4_moe"]
    spec = load_spec(path)
    with HFCheckpoint(path) as ckpt:
        keys = list(ckpt.keys())
    mtp = [  # GLM-4.5's MTP layer (model.layers.{num_hidden_layers}): a decoder layer plus its projections
        "model.layers.4.eh_proj.weight",
        "model.layers.4.enorm.weight",
        "model.layers.4.hnorm.weight",
        "model.layers.4.shared_head.norm.weight",
        *(f"model.layers.4.self_attn.{p}_proj.weight" for p in "qkv"),
        *(f"model.layers.4.mlp.experts.0.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    with pytest.raises(UserError, match="match no row"):
        resolve_checkpoint(spec.replace(mtp_num_layers=0), keys + mtp)
    capsys.readouterr()
    rows = resolve_checkpoint(spec, keys + mtp)
    assert "skipping 10 tensor(s) of 1 multi-token-prediction layer(s)" in capsys.readouterr().out
    assert sum(len(r.hf) for r in rows) == len(keys)


@pytest.fixture(scope="module")
def one_process_groups():
    """megatron-core's groups for one process (gloo), torn down and env restored after."""
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        yield


@pytest.mark.parametrize(
    "family, off",
    [
        ("glm4", {"rotary_interleaved": False}),
        ("glm4", {"rotary_percent": 1.0}),
        ("glm4_moe", {"rotary_interleaved": True}),
        ("glm4_moe", {"moe_router_num_groups": None, "moe_router_group_topk": None}),
        ("glm4_moe", {"moe_router_topk_scaling_factor": None}),
        ("glm4_moe", {"moe_router_pre_softmax": True}),
    ],
)
def test_logits_are_transformers_and_every_feature_is_live(tiny_dirs, family, off, one_process_groups):
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.schedule import forward_logits
    from megatron_bridge.runtime.weights import load_hf_weights

    path = tiny_dirs[family]
    spec = load_spec(path, make_vocab_size_divisible_by=8)
    ids, _ = make_batch(spec.vocab_size, seq=24)
    ref = hf_reference(path, ids)["logits"]
    for s, close in ((spec, True), (spec.replace(**off), False)):
        chunks = build_model(s, Layout())
        load_hf_weights(chunks, s, path)
        logits = forward_logits(chunks, ids)[..., : s.vocab_size]
        assert torch.allclose(logits, ref, rtol=0, atol=1e-4) == close, off
