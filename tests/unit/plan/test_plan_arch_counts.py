"""The planner's parameter counts for every architecture #14 adds, against transformers.

transformers is the oracle: each model is built on the meta device from its config class
(`AutoModelForCausalLM.from_config`, no memory, no weights) with a tiny config that switches
every feature of the family on (MoE with dense-first layers, MLA with and without q_lora_rank,
biases, sinks, sandwich norms, ...), and `count(spec).total` must equal `sum(p.numel())`.

The BridgeSpec counted is the one the family produces: `load_spec` for the families
registered on this branch (llama, mistral, qwen2, qwen3, mixtral, qwen2_moe); for the others
(being added in parallel) the spec is written by hand from the config by `_hand_spec` below,
with the BridgeSpec fields the family helper must set (that helper's contract; see the
planner section of docs/plan.md).

Per-rank shards: the HF tensors of each pipeline stage are classified by name as megatron-core
shards them (tp-split, replicated, expert) and their per-rank sum must equal `rank_params`
for every stage of pp/vpp/tp/ep/etp layouts, so that a stage counts the layers it really holds
(dense-first layers are cheaper than MoE ones).
"""

from __future__ import annotations

import pytest
import transformers as T

from megatron_bridge.bridge.hf_config import _moe_pattern, load_spec
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.parallel.dims import ParallelDims, padded_vocab_size
from megatron_bridge.plan import params as P
from megatron_bridge.runtime.tiny import tiny_config

BASE = dict(vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, num_key_value_heads=4)


def _hf_numel(cfg) -> int:
    import torch

    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def _hand_spec(cfg, **fields) -> BridgeSpec:
    """The spec an unregistered family must produce: the common fields from the config,
    the family's building blocks from `fields`."""
    h, a = cfg.hidden_size, cfg.num_attention_heads
    f = dict(
        family=cfg.model_type,
        architecture="",
        num_layers=cfg.num_hidden_layers,
        hidden_size=h,
        ffn_hidden_size=cfg.intermediate_size,
        num_attention_heads=a,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or a,
        head_dim=getattr(cfg, "head_dim", None) or h // a,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    f.update(fields)
    return BridgeSpec.make(**f)


def _moe(cfg, experts: int, *, shared: int | None = None, gate: bool = False, pattern=(), **kw) -> dict:
    return dict(
        num_moe_experts=experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size,
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=gate,
        moe_layer_pattern=tuple(pattern),
        **kw,
    )


def _deepseek(version: int, q_lora_rank: int | None):
    cls = T.DeepseekV3Config if version == 3 else T.DeepseekV2Config
    extra = dict(n_group=2, topk_group=1) if version == 3 else {}
    cfg = cls(**BASE, **MOE, **MLA, **extra, q_lora_rank=q_lora_rank, n_routed_experts=8, n_shared_experts=2)
    cfg.first_k_dense_replace = 1
    mla = dict(
        multi_latent_attention=True,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
    )
    routing = dict(moe_router_score_function="sigmoid", moe_router_expert_bias=True) if version == 3 else {}
    moe = _moe(cfg, 8, shared=2 * cfg.moe_intermediate_size, pattern=(0, 1, 1, 1), **routing)
    return cfg, _hand_spec(cfg, **mla, **moe)


def _qwen3_moe():
    cfg = T.Qwen3MoeConfig(**BASE, **MOE, num_experts=4, head_dim=8, decoder_sparse_step=2, mlp_only_layers=[3])
    pattern = _moe_pattern(cfg.to_dict(), 4)  # (0, 1, 0, 0): the spec_from_hf rule
    assert pattern == (0, 1, 0, 0)
    return cfg, _hand_spec(cfg, qk_layernorm=True, **_moe(cfg, 4, pattern=pattern))


def _olmoe():
    cfg = T.OlmoeConfig(
        **{**BASE, "intermediate_size": 16}, num_experts=4, num_experts_per_tok=2, num_key_value_heads=2
    )
    return cfg, _hand_spec(cfg, qk_layernorm=True, qk_norm_type="full", **_moe(cfg, 4))


def _olmo2():
    cfg = T.Olmo2Config(**BASE, num_key_value_heads=2)
    return cfg, _hand_spec(
        cfg, qk_layernorm=True, qk_norm_type="full", pre_norms=False, post_attention_norm=True, post_mlp_norm=True
    )


def _gemma(version: int):
    cls = T.Gemma3TextConfig if version == 3 else T.Gemma2Config
    cfg = cls(**BASE, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    extra = dict(qk_layernorm=True) if version == 3 else dict(attn_logit_softcapping=50.0)
    return cfg, _hand_spec(
        cfg,
        zero_centered_norm=True,
        post_attention_norm=True,
        post_mlp_norm=True,
        activation="gelu_tanh",
        embedding_multiplier=cfg.hidden_size**0.5,
        **extra,
    )


def _gpt_oss():
    cfg = T.GptOssConfig(**{**BASE, "intermediate_size": 16}, num_local_experts=4, num_experts_per_tok=2)
    cfg.num_key_value_heads, cfg.head_dim = 2, 8
    return cfg, _hand_spec(
        cfg,
        add_qkv_bias=True,
        attention_out_bias=True,
        attention_sinks=True,
        mlp_bias=True,
        glu_clamp=7.0,
        glu_alpha=1.702,
        glu_linear_offset=1.0,
        **_moe(cfg, 4, moe_router_bias=True),
    )


def _gpt_oss_add_bias_linear():
    """GPT-OSS described with megatron's add_bias_linear (every linear and the router biased)."""
    cfg, _ = _gpt_oss()
    return cfg, _hand_spec(cfg, add_bias_linear=True, attention_sinks=True, **_moe(cfg, 4))


def _glm4():
    cfg = _dense(T.Glm4Config, attention_bias=True, partial_rotary_factor=0.5)
    return cfg, _hand_spec(
        cfg,
        add_qkv_bias=True,
        post_attention_norm=True,
        post_mlp_norm=True,
        rotary_percent=0.5,
        rotary_interleaved=True,
    )


def _glm4_moe():
    cfg = T.Glm4MoeConfig(
        **BASE, **MOE, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1, attention_bias=True,
        use_qk_norm=True, first_k_dense_replace=1, n_group=1, topk_group=1,
    )  # fmt: skip
    moe = _moe(
        cfg, 4, shared=cfg.moe_intermediate_size, pattern=(0, 1, 1, 1), moe_router_score_function="sigmoid",
        moe_router_expert_bias=True,
    )  # fmt: skip
    return cfg, _hand_spec(cfg, add_qkv_bias=True, qk_layernorm=True, **moe)


def _dense(cls, **kw):
    return cls(**BASE, num_key_value_heads=2, pad_token_id=0, **kw)


def _llama_biases():
    cfg = _dense(T.LlamaConfig, attention_bias=True, mlp_bias=True)
    return cfg, _hand_spec(cfg, add_qkv_bias=True, attention_out_bias=True, mlp_bias=True)


HAND = {
    "deepseek_v3": lambda: _deepseek(3, 24),
    "deepseek_v3_no_q_lora": lambda: _deepseek(3, None),
    "deepseek_v2": lambda: _deepseek(2, 24),
    "deepseek_v2_lite": lambda: _deepseek(2, None),
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "olmo2": _olmo2,
    "gemma2": lambda: _gemma(2),
    "gemma3": lambda: _gemma(3),
    "gpt_oss": _gpt_oss,
    "gpt_oss_add_bias_linear": _gpt_oss_add_bias_linear,
    "glm4": _glm4,
    "glm4_moe": _glm4_moe,
    "phi3": lambda: (c := _dense(T.Phi3Config, partial_rotary_factor=0.5), _hand_spec(c, rotary_percent=0.5)),
    "granite": lambda: (
        c := _dense(T.GraniteConfig, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0),
        _hand_spec(c, embedding_multiplier=12.0, residual_multiplier=0.22, logits_scaling=8.0),
    ),
    "smollm3": lambda: (
        c := _dense(T.SmolLM3Config, no_rope_layers=[1, 1, 1, 0]),
        _hand_spec(c, nope_pattern=(0, 0, 0, 1)),
    ),
    "ministral": lambda: (
        c := _dense(T.MinistralConfig, sliding_window=8, head_dim=8),
        _hand_spec(c, sliding_window=8),
    ),
    "llama_biases": _llama_biases,
}

REGISTERED = {
    "llama": (T.LlamaConfig, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral": (T.MistralConfig, dict(num_key_value_heads=2, head_dim=16)),
    "qwen2": (T.Qwen2Config, dict(num_key_value_heads=2)),
    "qwen3": (T.Qwen3Config, dict(num_key_value_heads=2, head_dim=16)),
    "mixtral": (T.MixtralConfig, dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (
        T.Qwen2MoeConfig,
        dict(**MOE, num_experts=4, shared_expert_intermediate_size=24, mlp_only_layers=[1], qkv_bias=True),
    ),
}


def _registered(name, tmp_path):
    cls, kw = REGISTERED[name]
    cfg = cls(**BASE, **kw)
    cfg.save_pretrained(tmp_path)
    return cfg, load_spec(tmp_path)


def _case(name, tmp_path):
    return _registered(name, tmp_path) if name in REGISTERED else HAND[name]()


@pytest.mark.parametrize("name", [*REGISTERED, *HAND])
def test_count_equals_hf_numel_on_meta(name, tmp_path):
    cfg, spec = _case(name, tmp_path)
    assert P.count(spec).total == _hf_numel(cfg)


def test_qwen2_moe_mlp_only_layers_are_dense(tmp_path):
    """Qwen2-MoE's mlp_only_layers=[1]: layer 1 is a dense MLP of intermediate_size (the
    count used to treat every layer as MoE)."""
    _, spec = _registered("qwen2_moe", tmp_path)
    assert spec.moe_layer_pattern == (1, 0, 1, 1)
    c = P.count(spec)
    assert c.moe_layers == 3
    assert c.total == 3 * P.layer_shards(spec, True).total + P.layer_shards(spec, False).total + c.embedding + 32


# -- per-rank shards ------------------------------------------------------------------------
def _kind(name: str, w, head_dim: int) -> str:
    """How megatron-core holds HF tensor `name` (layer-local part of the name): 'tp' split,
    'rep' replicated, 'exp' split over ep·etp, 'exp_rep' (row-parallel expert bias) over ep."""
    if ".experts." in name:
        return "exp_rep" if name.endswith("down_proj_bias") or name.endswith("down_proj.bias") else "exp"
    if ("q_norm" in name or "k_norm" in name) and w.numel() > head_dim:  # full-projection qk norm
        return "tp"
    if "norm" in name or name.endswith("mlp.gate.weight") or ".router." in name or "shared_expert_gate" in name:
        return "rep"
    if name.endswith("o_proj.bias") or name.endswith("down_proj.bias"):
        return "rep"
    return "tp"


def _expected_rank(cfg, spec, named, ids, first, last, tp, ep, etp):
    total = 0.0
    h = spec.hidden_size
    vocab = padded_vocab_size(spec.vocab_size, spec.make_vocab_size_divisible_by, tp)
    for name, w in named.items():
        if ".layers." in name:
            if int(name.split(".layers.")[1].split(".")[0]) in ids:
                k = _kind(name, w, spec.head_dim)
                n = w.numel()
                total += {"tp": n / tp, "rep": n, "exp": n / (ep * etp), "exp_rep": n / ep}[k]
        elif "embed_tokens" in name:
            total += vocab * h / tp if first else 0
        elif name == "lm_head.weight":
            total += vocab * h / tp if last else 0
        elif last:  # final norm
            total += w.numel()
    if spec.tie_word_embeddings and last and not first:
        total += vocab * h / tp
    return total


LAYOUTS = [  # tp, pp, vpp, ep, etp, layers_first_stage, layers_last_stage
    (2, 2, 1, 2, 1, None, None),
    (2, 4, 1, 4, 2, None, None),
    (1, 2, 2, 2, 1, None, None),
    (2, 3, 1, 1, 1, 1, 1),
    (1, 1, 1, 2, 1, None, None),
]


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_lite", "qwen2_moe", "gpt_oss", "olmo2", "glm4_moe"])
def test_rank_shards_match_hf_tensors_per_stage(name, tmp_path):
    import torch

    cfg, spec = _case(name, tmp_path)
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg)
    named = dict(model.named_parameters())
    for tp, pp, vpp, ep, etp, lf, ll in LAYOUTS:
        seen = []
        for stage in range(pp):
            ids = ParallelDims(pp=pp, vpp=vpp, layers_first_stage=lf, layers_last_stage=ll).stage_layer_ids(
                spec.num_layers, stage
            )
            seen += ids
            first, last = stage == 0, stage == pp - 1
            got = P.rank_params(spec, tp=tp, ep=ep, etp=etp, layers=ids, first=first, last=last)
            want = _expected_rank(cfg, spec, named, ids, first, last, tp, ep, etp)
            assert got["dense"] + got["expert"] == pytest.approx(want, rel=1e-12), (tp, pp, vpp, ep, etp, stage)
        assert sorted(seen) == list(range(spec.num_layers))


# -- memory: MLA widths and per-stage layer mixes -------------------------------------------
@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_mla_attention_widths_are_what_attention_receives(q_lora_rank, monkeypatch):
    """The planner's Q/K/V widths for MLA are the tensors core attention gets (the
    up-projected heads, the rotary part of k broadcast to every head), recorded from a
    transformers DeepSeek-V3 forward."""
    import torch
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    cfg, spec = _deepseek(3, q_lora_rank)
    cfg._attn_implementation = "eager"
    seen = []
    real = mod.eager_attention_forward

    def spy(module, q, k, v, *a, **kw):
        seen.append(tuple(x.shape[1] * x.shape[3] for x in (q, k, v)))  # heads · width
        return real(module, q, k, v, *a, **kw)

    monkeypatch.setattr(mod, "eager_attention_forward", spy)
    cfg.num_hidden_layers = 1  # the dense first layer: shapes only, on the meta device
    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(cfg)
        model(torch.zeros(1, 5, dtype=torch.long))
    assert seen and all(w == P.attention_widths(spec) for w in seen)


def test_stage_memory_sums_the_kinds_of_its_layers():
    """DeepSeek's dense first layer: at pp2 stage 0 holds one dense and one MoE layer,
    stage 1 two MoE layers; activations and parameters follow the layers held."""
    from megatron_bridge.plan import comm as C
    from megatron_bridge.plan import memory as M

    _, spec = _deepseek(3, 24)
    kw = dict(p=2, tp=1, cp=1, ep=2, etp=1, dp=1, edp=1, zero=0, engine="megatron", precision="bf16")
    kw.update(recompute="selective", sp=False, s=64, b=1, num_micro=4, vocab=256)
    act = {moe: M.layer_activations(spec, recompute="selective", s=64, b=1, moe=moe, etp=1) for moe in (True, False)}
    assert act[True] != act[False]
    for stage, ids in ((0, (0, 1)), (1, (2, 3))):
        assert ParallelDims(pp=2).stage_layer_ids(4, stage) == ids
        sm = M.stage_memory(spec, stage=stage, layers=ids, first=stage == 0, last=stage == 1, **kw)
        flight = M.in_flight(stage, 2, 4)
        assert sm.activations == pytest.approx(flight * sum(act[P.is_moe_layer(spec, i)] for i in ids) + (
            flight * 64 * spec.hidden_size if stage == 0 else 0))  # fmt: skip
        rp = P.rank_params(spec, tp=1, ep=2, etp=1, layers=ids, first=stage == 0, last=stage == 1)
        assert sm.params == rp["dense"] + rp["expert"]
    # CP exchanges the up-projected K and V of every head (not the latent).
    cp = C.step_comm(
        spec, tp=1, cp=2, dp=1, pp=1, ep=1, etp=1, edp=1, vpp=1, sp=False, zero=0, recompute="none", s=64, b=1,
        num_micro=1, layers=1, dense_params=0, expert_params=0, spans={}, intra_gbps=1, inter_gbps=1,
    )["cp"]  # fmt: skip
    _, k, v = P.attention_widths(spec)
    assert cp["volume_bytes"] == 3 * 1 * 32 * (k + v) * 2


@pytest.mark.parametrize("family", list(TINY))
def test_every_tiny_family_counts_what_transformers_builds(family, tmp_path):
    """The spec each registered family really produces (bridge/tiny.py: every feature of the
    family on), through `load_spec`, counts what transformers builds."""
    cfg = tiny_config(family)
    cfg.save_pretrained(tmp_path)
    assert P.count(load_spec(tmp_path)).total == _hf_numel(cfg)
