"""Config bridge, family registry and tables against real transformers checkpoints (no processes).

Tiny models of every family are built from their transformers config classes and saved with
`save_pretrained`; the tests check what the bridge reads from config.json, what it refuses,
that each family's table consumes every tensor of the checkpoint and that HF -> shards -> HF
is bit-exact for tp 1/2/4 (expert-TP too), and the offline per-rank enumeration.
"""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge import registry
from megatron_bridge.bridge.hf_config import load_spec, spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.layout import Coords, Layout, renumber
from megatron_bridge.bridge.loader import HFCheckpoint, rank_shards, resolve_checkpoint
from megatron_bridge.bridge.shards import Shard
from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.rope import rope_inv_freq
from megatron_bridge.runtime.tconfig import transformer_config
from megatron_bridge.runtime.tiny import make_tiny

FAMILIES = list(TINY)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny(fam, root / fam) for fam in FAMILIES}


def test_registry_lists_every_family():
    text = registry.describe()
    for fam in FAMILIES:
        assert fam in text
    assert registry.family_for({"architectures": ["Qwen3ForCausalLM"]}).name == "qwen3"
    assert registry.family_for({"model_type": "mixtral"}).name == "mixtral"
    with pytest.raises(UserError, match="GPT2LMHeadModel"):
        registry.family_for({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


def test_specs_of_tiny_families(tiny):
    s = {f: load_spec(p, make_vocab_size_divisible_by=8) for f, p in tiny.items()}
    assert s["llama"].rope_type == "llama3" and dict(s["llama"].rope_params)["factor"] == 4.0
    assert s["mistral"].sliding_window == 8 and s["mistral"].num_query_groups == 1
    assert s["qwen2"].add_qkv_bias and s["qwen2"].tie_word_embeddings and s["qwen2"].sliding_window is None
    assert s["qwen3"].qk_layernorm and s["qwen3"].head_dim == 16 and not s["qwen3"].add_qkv_bias
    mx, qm = s["mixtral"], s["qwen2_moe"]
    assert (mx.num_moe_experts, mx.moe_router_topk, mx.moe_ffn_hidden_size) == (4, 2, 48)
    assert not mx.moe_router_pre_softmax and mx.moe_shared_expert_intermediate_size is None
    assert qm.moe_router_pre_softmax and qm.moe_shared_expert_gate and qm.moe_shared_expert_intermediate_size == 48
    assert qm.moe_layer_pattern == (1, 0, 1, 1) and qm.add_qkv_bias
    assert all(x.padded_vocab_size(1) == 256 and x.padded_vocab_size(4) == 256 for x in s.values())


def _base(**kw):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
    }
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"attention_bias": True}, "o_proj bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "SwiGLU"),
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "proportional"),
        ({"rope_scaling": {"type": "yarn"}}, "yarn rope scaling without 'factor'"),
        ({"rope_parameters": {"rope_type": "default", "mrope_section": [2, 2, 4]}}, "mrope"),
        ({"layer_types": ["full_attention", "chunked_attention"], "sliding_window": 4}, "chunked_attention"),
    ],
)
def test_unsupported_features_are_refused(extra, message):
    with pytest.raises(UserError, match=message):
        spec_from_hf(_base(**extra))


def test_moe_refusals_and_all_problems_at_once():
    cfg = _base(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.1,
        attention_bias=True,
    )
    with pytest.raises(UserError) as e:
        spec_from_hf(cfg)
    assert "router_jitter_noise" in str(e.value) and "o_proj" in str(e.value)


def test_v4_style_rope_scaling_and_window_keys():
    s = spec_from_hf(
        _base(
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    assert s.rotary_base == 5e5 and s.rope_type == "llama3"
    q = spec_from_hf(
        _base(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, sliding_window=4096)
    )
    assert q.sliding_window is None and q.add_qkv_bias


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_frequencies_match_transformers(rope):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters=dict(rope))
    spec = spec_from_hf(_base(hidden_size=64, rope_parameters=dict(rope)))
    if rope["rope_type"] == "default":
        want = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu")
    assert torch.equal(rope_inv_freq(spec), want)


def test_config_written_back_reads_the_same(tiny):
    from transformers import AutoConfig, AutoModelForCausalLM

    for fam, path in tiny.items():
        spec = load_spec(path)
        cfg = spec_to_hf_config(spec)
        assert spec_from_hf(cfg) == spec, fam
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
        ck = HFCheckpoint(path)
        saved = set(ck.keys())
        built = set(model.state_dict())  # persistent buffers too (DeepSeek-V3's correction bias)
        if spec.is_moe:  # transformers 5 fuses experts in memory, saves them per expert: same size
            state = model.state_dict()
            total = sum(p.numel() for p in model.parameters()) + sum(
                b.numel() for n, b in model.named_buffers() if n in state
            )
            assert sum(ck.tensor(k).numel() for k in saved) == total, fam
        else:
            assert saved <= built, fam


@pytest.mark.parametrize("fam", FAMILIES)
def test_table_consumes_checkpoint_and_shards_round_trip(tiny, fam):
    spec = load_spec(tiny[fam], make_vocab_size_divisible_by=8)
    ck = HFCheckpoint(tiny[fam])
    rows = resolve_checkpoint(spec, ck.keys())
    assert {h for r in rows for h in r.hf} == set(ck.keys())
    for tp in (1, 2, 4):
        if layout_violations(tiny[fam], Layout(tp=tp), world=tp):
            continue
        shapes = spec.shapes(tp)
        for r in rows:  # select: one expert's slab of a stacked-experts tensor (GPT-OSS), else as is
            src = r.select([ck.tensor(h) for h in r.hf])
            parts = [r.mapping.shard(r.select([ck.slice(h) for h in r.hf]), Shard(i, tp), shapes) for i in range(tp)]
            back = r.mapping.merge(parts, shapes)
            assert all(torch.equal(a, b) for a, b in zip(back, src)), (fam, tp, r.megatron)


def layout_violations(hf_dir, layout, world, seq_length=128):
    """The layout rules (`mbr check`'s, convert's and verify's) for an HF model."""
    from megatron_bridge.backends.describe import describe
    from megatron_bridge.config.schema import Config
    from megatron_bridge.parallel.rules.registry import check_all

    cfg = Config()
    cfg.train.seq_length = seq_length
    return check_all(layout.with_world(world), describe(cfg.model, hf_path=hf_dir), cfg, layout_only=True)[0]


def test_layout_rules_are_spelled_out(tiny):
    assert layout_violations(tiny["mixtral"], Layout(tp=2, pp=2, ep=2), world=8) == []
    assert layout_violations(tiny["mixtral"], Layout(tp=2, pp=2, ep=2, etp=1), world=4) == []
    bad = layout_violations(tiny["mixtral"], Layout(tp=3, pp=3, ep=3, cp=2), world=4, seq_length=30)
    assert {v.rule for v in bad} >= {"heads-tp", "kv-heads-tp", "layers-pp", "experts-ep", "world-size", "seq-cp"}
    assert [v.rule for v in layout_violations(tiny["llama"], Layout(ep=2), world=2)] == ["ep-dense"]


def test_transformer_config_and_stage_split(tiny):
    spec = load_spec(tiny["qwen2_moe"])
    tc = transformer_config(spec, Layout(tp=2, pp=2, vpp=2, ep=2, sequence_parallel=True))
    assert (tc.num_moe_experts, tc.moe_shared_expert_gate, tc.moe_router_pre_softmax) == (4, True, True)
    assert tc.moe_layer_freq == [1, 0, 1, 1] and tc.add_qkv_bias and tc.sequence_parallel
    assert (tc.pipeline_model_parallel_size, tc.virtual_pipeline_model_parallel_size) == (
        2,
        2,
    )  # the split: test_stage_split
    mistral = transformer_config(load_spec(tiny["mistral"]), Layout())
    assert mistral.window_size == (7, 0) and mistral.num_query_groups == 1
    uneven = transformer_config(load_spec(tiny["llama"]), Layout(pp=3, layers_first_stage=1, layers_last_stage=1))
    assert (uneven.num_layers_in_first_pipeline_stage, uneven.num_layers_in_last_pipeline_stage) == (1, 1)


def test_offline_rank_shards_rebuild_every_tensor(tiny):
    """Without a model or process group: every rank's shards of a tp2·pp2·ep2 layout put
    back together give each HF tensor exactly once (the converter's path)."""
    spec = load_spec(tiny["qwen2_moe"], make_vocab_size_divisible_by=8)
    lay = Layout(tp=2, pp=2, ep=2)
    ck = HFCheckpoint(tiny["qwen2_moe"])
    rows = {r.megatron: r for r in resolve_checkpoint(spec, ck.keys())}
    pieces = {}
    for pp in range(2):
        layers = lay.stage_layers(spec.num_layers, pp)
        for ep in range(2):
            for tp in range(2):
                for local, t in rank_shards(spec, lay, ck, Coords(tp_rank=tp, pp_rank=pp, ep_rank=ep, etp_rank=tp)):
                    exp = 2 * ep if ".local_experts." in local else 0
                    name = renumber(local, layers.start if local.startswith("decoder.layers.") else 0, exp)
                    pieces.setdefault(name, {})[tp] = t
    assert set(pieces) == set(rows)
    shapes = spec.shapes(2)
    for name, parts in pieces.items():
        r = rows[name]
        back = r.mapping.merge([parts[i] for i in sorted(parts)], shapes)
        assert all(torch.equal(a, ck.tensor(h)) for a, h in zip(back, r.hf)), name


def test_spec_from_a_recipe_model_group():
    """A model defined by a recipe (no HF source) gets a spec and a config.json to export with."""
    from megatron_bridge.backends.describe import describe
    from megatron_bridge.config.schema import ModelConfig
    from megatron_bridge.errors import LayoutError

    m = ModelConfig(
        family="qwen2",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        tie_word_embeddings=True,
    )
    spec = describe(m)
    assert spec.add_qkv_bias and spec.num_query_groups == 2 and spec.architecture == "Qwen2ForCausalLM"
    assert spec_from_hf(spec_to_hf_config(spec)) == spec
    with pytest.raises(LayoutError, match="model-family"):
        describe(ModelConfig(family="gpt2"))
    with pytest.raises(UserError, match="no Hugging Face counterpart"):
        spec_to_hf_config(describe(ModelConfig(family="gpt")))


def test_every_model_field_reaches_the_spec():
    """ModelConfig -> BridgeSpec copies by name: a model field the builder would not see
    must be named as such (and then be resolved into the spec under another name)."""
    import dataclasses

    from megatron_bridge.backends.describe import describe
    from megatron_bridge.backends.native.backend import NOT_SPEC_FIELDS
    from megatron_bridge.bridge.spec import field_names
    from megatron_bridge.config.schema import ModelConfig

    spec_fields = field_names()
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert model_fields - spec_fields <= set(NOT_SPEC_FIELDS)
    m = ModelConfig(
        family="gpt",
        normalization="LayerNorm",
        gated_linear_unit=False,
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
        kv_channels=32,
        num_query_groups=2,
    )
    spec = describe(m)
    for name in model_fields & spec_fields - {"family", "backend"}:  # backend: auto resolves to one
        assert getattr(spec, name) == getattr(m, name), name
    assert spec.backend == "native"
    assert (spec.head_dim, spec.num_query_groups) == (32, 2)


def test_sizes_are_whole_numbers_within_sane_limits():
    """`num_hidden_layers: 1e8` (a hang in convert, gigabytes in export) and `"4"` (a string)
    are one message each; per-layer lists pass through to the feature that reads them."""
    import pytest

    from megatron_bridge.bridge.hf_config import base_fields
    from megatron_bridge.errors import UserError

    assert base_fields({"num_hidden_layers": 4.0, "vocab_size": 256})["num_layers"] == 4
    assert base_fields({"intermediate_size": [64, 128]})["ffn_hidden_size"] == [64, 128]
    with pytest.raises(UserError, match="outside the sane range 0..10000"):
        base_fields({"num_hidden_layers": 100_000_000})
    with pytest.raises(UserError, match='without quotes \\("num_hidden_layers": 4'):
        base_fields({"num_hidden_layers": "4"})
    for bad in (True, 2.5, -1):
        with pytest.raises(UserError):
            base_fields({"hidden_size": bad})
    with pytest.raises(UserError, match="num_local_experts"):
        base_fields({"num_local_experts": 10**9})
