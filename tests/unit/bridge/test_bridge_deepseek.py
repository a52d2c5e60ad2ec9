"""DeepSeek-V2/V3: the router against transformers' routers, what the configs turn on and
refuse, V2-Lite's table (no q_lora_rank), and MTP layers skipped with a note (no processes;
logits/grads of the whole model are `mbr verify`'s)."""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge.hf_config import load_spec, spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import HFCheckpoint, resolve_checkpoint
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.moe_routing import route
from megatron_bridge.runtime.tconfig import transformer_config
from megatron_bridge.runtime.tiny import tiny_config


def _hf_router(family: str, **overrides):
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    cfg = tiny_config(family, **overrides)
    cls = v3.DeepseekV3TopkRouter if family == "deepseek_v3" else v2.DeepseekV2TopkRouter
    router = cls(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.num_experts, generator=g))
    return cfg, router


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("deepseek_v3", {}),
        ("deepseek_v3", {"norm_topk_prob": False, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 3}),
        ("deepseek_v2", {}),
        ("deepseek_v2", {"topk_method": "greedy", "n_group": None, "topk_group": None}),
    ],
)
def test_router_matches_transformers(family, overrides):
    cfg, router = _hf_router(family, **overrides)
    spec = spec_from_hf(cfg.to_dict())
    x = torch.randn(64, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    _, w_ref, idx_ref = router(x)
    logits = x @ router.weight.T
    bias = getattr(router, "e_score_correction_bias", None)
    probs, routing_map = route(
        logits,
        topk=spec.moe_router_topk,
        score_function=spec.moe_router_score_function,
        bias=bias if spec.moe_router_expert_bias else None,
        num_groups=spec.moe_router_num_groups,
        group_topk=spec.moe_router_group_topk,
        renormalize=not spec.moe_router_pre_softmax,
        scaling=spec.moe_router_topk_scaling_factor,
    )
    ref = torch.zeros_like(probs).scatter(1, idx_ref, w_ref)
    assert torch.equal(routing_map, ref != 0) or torch.equal(routing_map.sum(1), torch.full((64,), idx_ref.shape[1]))
    torch.testing.assert_close(probs, ref, rtol=0, atol=1e-6)


def test_specs_and_megatron_config():
    v3 = spec_from_hf(tiny_config("deepseek_v3").to_dict())
    assert v3.multi_latent_attention and (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_head_dim, v3.v_head_dim) == (
        24,
        16,
        8,
        12,
    )
    assert (v3.moe_router_score_function, v3.moe_router_expert_bias, v3.moe_router_num_groups) == ("sigmoid", True, 4)
    assert v3.moe_layer_pattern == (0, 1, 1, 1) and v3.moe_shared_expert_intermediate_size == 16
    assert v3.moe_router_topk_scaling_factor == 2.5 and not v3.moe_router_pre_softmax and v3.mtp_num_layers == 1
    tc = transformer_config(v3, Layout(tp=2, ep=2, sequence_parallel=True))
    assert type(tc).__name__ == "MLATransformerConfig" and tc.rope_type == "yarn" and tc.q_lora_rank == 24
    assert not tc.moe_router_enable_expert_bias  # megatron must never update the correction bias
    lite = spec_from_hf(tiny_config("deepseek_v2", q_lora_rank=None).to_dict())
    assert lite.q_lora_rank is None and lite.moe_router_pre_softmax and lite.moe_router_score_function == "softmax"
    for s in (v3, lite):
        assert spec_from_hf(spec_to_hf_config(s)) == s


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "attention_factor": 2.0}},
            "yarn",
        ),
        ("deepseek_v3", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}, "with MLA"),
    ],
)
def test_refusals(family, overrides, message):
    with pytest.raises(UserError, match=message):
        spec_from_hf(tiny_config(family, **overrides).to_dict())
    cfg = tiny_config("deepseek_v3").to_dict()
    cfg["moe_layer_freq"] = 2
    with pytest.raises(UserError, match="moe_layer_freq"):
        spec_from_hf(cfg)


def test_v2_lite_table_and_mtp_skip(tmp_path, capsys):
    from megatron_bridge.runtime.tiny import make_tiny

    lite = make_tiny("deepseek_v2", tmp_path / "lite", q_lora_rank=None)
    spec = load_spec(lite)
    with HFCheckpoint(lite) as ckpt:
        keys = ckpt.keys()
        rows = resolve_checkpoint(spec, keys)
    names = {r.megatron for r in rows}
    assert "decoder.layers.0.self_attention.linear_q_proj.weight" in names
    assert not any("q_down_proj" in n or "q_layernorm" in n for n in names)
    assert sum(len(r.hf) for r in rows) == len(keys)  # every tensor consumed
    v3 = spec_from_hf(tiny_config("deepseek_v3").to_dict())
    mtp = ["model.layers.4.eh_proj.weight", "model.layers.4.self_attn.q_a_proj.weight"]
    base = [k.replace("q_proj", "q_a_proj") for k in keys if k.startswith("model.layers.0.self_attn")]
    with pytest.raises(UserError, match="match no row"):
        resolve_checkpoint(v3.replace(mtp_num_layers=0), base + mtp)
    capsys.readouterr()
    resolve_checkpoint(v3, [k for k in base if "q_a_proj" not in k] + mtp)
    assert "skipping 2 tensor(s) of 1 multi-token-prediction layer(s)" in capsys.readouterr().out


@pytest.mark.parametrize("mscale_all_dim", [None, 0.8])
def test_yarn_frequencies_match_transformers(mscale_all_dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_bridge.runtime.blocks.mla import yarn_inv_freq

    cfg = tiny_config("deepseek_v3")
    rope = dict(cfg.rope_parameters, mscale=1.0, mscale_all_dim=mscale_all_dim, beta_fast=16)
    cfg = tiny_config("deepseek_v3", rope_parameters=rope)
    spec = spec_from_hf(cfg.to_dict())
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    inv, factor = yarn_inv_freq(spec)
    assert torch.equal(inv, inv_ref) and factor == factor_ref
    tc = transformer_config(spec, Layout())
    assert tc.rope_type == "yarn" and tc.mscale_all_dim == (mscale_all_dim or 0.0)


def test_layout_rules_for_mla(tmp_path):
    from megatron_bridge.backends.describe import describe
    from megatron_bridge.config.schema import Config
    from megatron_bridge.parallel.rules.registry import check_all
    from megatron_bridge.runtime.tiny import make_tiny

    def rules(hf_dir, layout, world):
        cfg = Config()
        cfg.model.hf_path = str(hf_dir)
        cfg.train.seq_length = 64
        return {v.rule for v in check_all(layout.with_world(world), describe(cfg.model), cfg, layout_only=True)[0]}

    good = make_tiny("deepseek_v3", tmp_path / "v3")
    assert rules(good, Layout(tp=2, ep=2, cp=2), 8) == set()  # MoE counted from n_routed_experts
    odd = make_tiny("deepseek_v3", tmp_path / "odd", q_lora_rank=20, num_attention_heads=8, num_key_value_heads=8)
    assert rules(odd, Layout(tp=8), 8) == {"mla-q-lora-tp"}
