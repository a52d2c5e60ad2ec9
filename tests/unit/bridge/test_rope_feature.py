"""features/rope.py against transformers: frequencies and attention factors of every rope
type, interleaved rotary (GLM-4), per-layer rope base (Gemma 3), NoPE layers (SmolLM3) and
the refusals. Whole-model parity (CP, PP, TP) is `mbr verify verify.tiny=phi3|smollm3|ministral3`.
"""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge.features.rope import attention_factor, layer_rope
from megatron_bridge.bridge.hf_config import spec_from_hf, spec_to_hf_config
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.rope import rope_inv_freq


def _hf(**kw):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "vocab_size": 100,
        "max_position_embeddings": 128,
    }
    cfg.update(kw)
    return cfg


YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 16}
CASES = {
    "yarn": (YARN, None),
    "yarn-mscale": ({**YARN, "mscale": 0.7, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}, None),
    "yarn-partial-no-truncate": ({**YARN, "partial_rotary_factor": 0.5, "truncate": False}, None),
    "yarn-attention-factor": ({**YARN, "attention_factor": 1.5}, None),
    "dynamic-short": ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.3}, 64),
    "dynamic-long": ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.3}, 300),
}


@pytest.mark.parametrize("name", list(CASES))
def test_frequencies_and_attention_factor_match_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope, seq_len = CASES[name]
    cfg = LlamaConfig(**{k: v for k, v in _hf().items() if k not in ("architectures", "model_type")})
    cfg.rope_parameters = dict(rope)
    want, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", seq_len=seq_len)
    spec = spec_from_hf(_hf(rope_parameters=dict(rope)))
    assert torch.equal(rope_inv_freq(spec, seq_len), want), name
    assert attention_factor(spec) == scale
    assert spec_from_hf(spec_to_hf_config(spec)) == spec


@pytest.mark.parametrize("seq_len", [None, 16, 17, 32])
def test_longrope_picks_short_or_long_factors_as_transformers(seq_len):
    """Phi-3: short factors up to original_max_position_embeddings, long beyond; the
    attention factor from max/original; the top-level original length wins."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0, 1.5, 2.0, 3.0]}
    rope |= {"long_factor": [2.0, 3.0, 5.0, 9.0], "partial_rotary_factor": 0.5}
    hf = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=128, original_max_position_embeddings=16)
    cfg = Phi3Config(**hf, rope_parameters=dict(rope))
    want, scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
    spec = spec_from_hf(_hf(architectures=["Phi3ForCausalLM"], model_type="phi3", **hf, rope_parameters=dict(rope)))
    assert spec.rotary_percent == 0.5 and spec.rope_type == "longrope"
    assert torch.equal(rope_inv_freq(spec, seq_len), want)
    assert attention_factor(spec) == scale > 1
    assert layer_rope(spec, 0) == {"base": None, "scale": scale, "rot": 8, "beta": None, "omax": 16}


def test_interleaved_rotary_is_glm4s():
    """megatron's rotary_interleaved with partial rotary computes transformers' Glm4
    apply_rotary_pos_emb (pairs (2i, 2i+1), cos/sin repeated per pair)."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers import Glm4Config
    from transformers.models.glm4.modeling_glm4 import Glm4RotaryEmbedding, apply_rotary_pos_emb

    cfg = Glm4Config(hidden_size=64, num_attention_heads=4, head_dim=16, partial_rotary_factor=0.5)
    rot = Glm4RotaryEmbedding(cfg)
    s, h = 12, 4
    q, k = torch.randn(1, h, s, 16), torch.randn(1, h, s, 16)
    pos = torch.arange(s)[None]
    cos, sin = rot(q, pos)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    spec = spec_from_hf(_hf(hidden_size=64, head_dim=16, partial_rotary_factor=0.5)).replace(rotary_interleaved=True)
    inv = rope_inv_freq(spec)
    assert torch.equal(inv, rot.inv_freq)
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(s, -1)[
        :, None, None, :
    ]  # megatron's get_emb
    for x, want in ((q, want_q), (k, want_k)):
        got = _apply_rotary_pos_emb_bshd(x.permute(2, 0, 1, 3), emb, rotary_interleaved=True)
        torch.testing.assert_close(got.permute(1, 2, 0, 3), want, rtol=0, atol=1e-6)


def test_local_rope_base_of_sliding_layers_is_gemma3s():
    """Gemma 3: sliding layers use default rope with their own base, full layers the
    model's (scaled) rope; the local layers' frequencies equal transformers'."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    arch = {"architectures": ["MinistralForCausalLM"], "model_type": "ministral"}  # writes layer_types back
    hf = _hf(head_dim=16, sliding_window=8, layer_types=types, rope_parameters=rope, **arch)
    spec = spec_from_hf(hf)
    assert (spec.rotary_base, spec.rope_type, spec.rope_local_base) == (1e6, "linear", 1e4)
    assert spec.window_pattern == (1, 1, 0, 1)
    local = [layer_rope(spec, i) for i in range(4)]
    assert [r and r["base"] for r in local] == [1e4, 1e4, None, 1e4]
    assert spec_from_hf(spec_to_hf_config(spec)) == spec
    # legacy spelling
    assert spec_from_hf(_hf(sliding_window=8, layer_types=types, rope_local_base_freq=1e3)).rope_local_base == 1e3
    assert spec_from_hf(_hf(sliding_window=8, layer_types=types, rope_local_base_freq=1e4)).rope_local_base is None

    cfg = Gemma3TextConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, num_hidden_layers=4, layer_types=types, rope_parameters=rope
    )
    hf_rot = Gemma3RotaryEmbedding(cfg)
    own = spec.replace(rotary_base=spec.rope_local_base, rope_type="default", rope_params=())
    assert torch.equal(rope_inv_freq(own), hf_rot.sliding_attention_inv_freq)
    assert torch.equal(rope_inv_freq(spec), hf_rot.full_attention_inv_freq)


def test_local_rope_layers_get_their_own_attention_module():
    from megatron_bridge.runtime.blocks.rope import RopeBlock, RopeSelfAttention

    class Sub:
        pass

    class LayerSpec:
        submodules = Sub()

    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import ModuleSpec

    hf = _hf(sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, rope_local_base_freq=1e3)
    spec = spec_from_hf(hf)
    kinds = []
    for i in range(4):
        ls = LayerSpec()
        ls.submodules = Sub()
        ls.submodules.self_attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": 1}, submodules="qkv")
        RopeBlock.layer(spec, i, ls)
        attn = ls.submodules.self_attention
        kinds.append(attn.module is RopeSelfAttention)
        assert attn.submodules == "qkv" and attn.params["attn_mask_type"] == 1
    assert kinds == [True, False, True, False]


def test_nope_layers_follow_transformers_smollm3():
    """`no_rope_layers[i] == 1` means layer i uses rope; absent, every 4th layer is NoPE."""
    from transformers import SmolLM3Config

    base = dict(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, intermediate_size=64, vocab_size=100)
    arch = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3"}
    for extra in ({}, {"no_rope_layers": [1, 0, 0, 1, 1, 1, 1, 0]}, {"no_rope_layer_interval": 2}):
        cfg = SmolLM3Config(**base, **extra)
        spec = spec_from_hf({**arch, **base, **extra})
        assert spec.nope_pattern == tuple(1 - x for x in cfg.no_rope_layers)
        assert spec_from_hf(spec_to_hf_config(spec)) == spec
        kw: dict = {}
        from megatron_bridge.runtime.blocks.rope import RopeBlock

        RopeBlock.config(spec, kw)
        assert kw["no_rope_freq"] == list(spec.nope_pattern)
    all_rope = spec_from_hf({**arch, **base, "no_rope_layers": [1] * 8})
    assert all_rope.nope_pattern == () and spec_to_hf_config(all_rope)["no_rope_layers"] == [1] * 8


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "proportional"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0]}}, "long_factor"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "sliding-window layers",
        ),
        ({"no_rope_layers": [1, 0]}, "no_rope_layers has 2 entries"),
    ],
)
def test_rope_refusals(extra, message):
    with pytest.raises(UserError, match=message):
        spec_from_hf(_hf(**extra))


@pytest.fixture(scope="module")
def one_process_groups():
    """megatron-core's groups for one process (gloo), torn down and env restored after."""
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        yield


def test_layers_with_their_own_rope_base_compute_transformers_logits(tmp_path, one_process_groups):
    """The per-layer rotary end to end: a Ministral whose layers all slide, described with a
    scaled model-wide rope (base 5e5, linear x4) and rope_local_base 1e4, must give the
    logits of the transformers model with default rope at base 1e4 — every layer's
    RopeSelfAttention has to replace the model-wide embedding with its own."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.schedule import forward_logits
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import load_hf_weights

    path = make_tiny("ministral", tmp_path / "m", layer_types=["sliding_attention"] * 4)
    spec = load_spec(path, make_vocab_size_divisible_by=8)
    assert spec.window_pattern == () and spec.sliding_window == 8
    ids, _ = make_batch(spec.vocab_size, seq=24)
    ref = hf_reference(path, ids)["logits"]
    scaled = spec.replace(rotary_base=5e5, rope_type="linear", rope_params=(("factor", 4.0),))
    for s, close in ((scaled, False), (scaled.replace(rope_local_base=1e4), True)):
        chunks = build_model(s, Layout())
        load_hf_weights(chunks, s, path)
        logits = forward_logits(chunks, ids)[..., : s.vocab_size]
        assert torch.allclose(logits, ref, atol=1e-4) == close


@pytest.mark.parametrize("family", ["ministral3", "ministral-local"])
def test_packed_sequences_restart_every_per_layer_rotary(tmp_path, family, one_process_groups):
    """THD packing: the per-layer rotary (own base; yarn factor and Llama-4 query scaling,
    which depend on the position) restarts at every sequence, so a packed row gives the
    logits of its sequences run one by one."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.packing import packed_seq_params
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import load_hf_weights

    local = family == "ministral-local"
    extra = {"layer_types": ["sliding_attention", "full_attention"] * 2} if local else {}
    path = make_tiny(family.split("-")[0], tmp_path / family, **extra)
    spec = load_spec(path, make_vocab_size_divisible_by=8)
    if local:
        spec = spec.replace(rope_local_base=500.0)
    assert any(layer_rope(spec, i) for i in range(4))
    (model,) = build_model(spec, Layout())
    load_hf_weights([model], spec, path)
    model.eval()
    lengths = (20, 12)  # the first passes original_max_position_embeddings (16) of ministral3
    ids = torch.randint(0, spec.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(ids, pos, None, packed_seq_params=packed_seq_params(seg))
        alone = [model(x, torch.arange(x.shape[1])[None], None) for x in ids.split(lengths, dim=1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "family, overrides, seq, plain",
    [
        ("phi3", {}, 12, False),  # longrope: 12 <= original 16, the short factors (verify covers the long ones)
        (
            "llama",
            {"max_position_embeddings": 16, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            24,
            False,
        ),
        (
            "llama",
            {"max_position_embeddings": 64, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            24,
            True,
        ),
    ],
)
def test_length_dependent_rope_gives_transformers_logits(tmp_path, family, overrides, seq, plain, one_process_groups):
    """The frequencies megatron's rotary gets for the batch's length are transformers' for
    the same batch (dynamic NTK rescales past max_position_embeddings, a fresh model)."""
    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.schedule import forward_logits
    from megatron_bridge.runtime.tiny import make_tiny
    from megatron_bridge.runtime.weights import load_hf_weights

    path = make_tiny(family, tmp_path / family, **overrides)
    spec = load_spec(path, make_vocab_size_divisible_by=8)
    ids, _ = make_batch(spec.vocab_size, seq=seq)
    ref = hf_reference(path, ids)["logits"]
    for s, close in ((spec, True), (spec.replace(rope_type="default", rope_params=()), plain)):
        chunks = build_model(s, Layout())
        load_hf_weights(chunks, s, path)
        logits = forward_logits(chunks, ids)[..., : s.vocab_size]
        assert torch.allclose(logits, ref, rtol=0, atol=1e-4) == close  # plain rope only up to the original length
