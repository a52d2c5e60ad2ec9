"""Gemma 2 / Gemma 3 / Granite building blocks against transformers' own code (no processes):
attention logit soft-capping (also under CP chunking and packed sequences), GeGLU, the
embedding multiplier in low precision, logits scaling and capping with the vocab-padding
mask, the zero-centred norm, and what the families read, write and refuse.

The whole models are checked end to end by `mbr verify verify.tiny=gemma2|gemma3_text|granite`.
"""

from __future__ import annotations

import pytest
import torch

from megatron_bridge.bridge.hf_config import load_spec, spec_from_hf, spec_to_hf_config
from megatron_bridge.bridge.loader import HFCheckpoint, resolve_checkpoint
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.scaling import scale_and_cap_logits, scale_embedding
from megatron_bridge.runtime.cp_attention import (
    allowed_mask,
    cp_positions,
    eager_attention,
    merge_from_cp,
    split_for_cp,
)
from megatron_bridge.runtime.packing import segment_mask
from megatron_bridge.runtime.tconfig import activation_func
from megatron_bridge.runtime.tiny import make_tiny


def _qkv(s=12, heads=4, groups=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, s, d, generator=g) * 2
    k = torch.randn(1, groups, s, d, generator=g) * 2
    v = torch.randn(1, groups, s, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_eager_attention_equals_transformers_eager(window):
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    q, k, v = _qkv()
    s = q.shape[2]
    allowed = allowed_mask(torch.arange(s), torch.arange(s), True, window)
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=2, head_dim=8, training=False)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3, softcap=1.5)
    got = eager_attention(q, k, v, allowed, scale=0.3, cap=1.5)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=1e-6)
    # the cap matters here: without it the result differs
    uncapped = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3, enable_gqa=True)
    assert (uncapped - got).abs().max() > 1e-3


def test_eager_attention_under_cp_chunks_and_packing():
    q, k, v = _qkv(s=16)
    s, cp = 16, 2
    full = eager_attention(q, k, v, allowed_mask(torch.arange(s), torch.arange(s), True, None), 0.3, 1.0)
    k_pos = torch.cat([cp_positions(s // cp, cp, r) for r in range(cp)])
    k_all = torch.cat([split_for_cp(k, cp, r, seq_dim=2) for r in range(cp)], dim=2)
    v_all = torch.cat([split_for_cp(v, cp, r, seq_dim=2) for r in range(cp)], dim=2)
    outs = []
    for r in range(cp):
        m = allowed_mask(cp_positions(s // cp, cp, r), k_pos, True, None)
        outs.append(eager_attention(split_for_cp(q, cp, r, seq_dim=2), k_all, v_all, m, 0.3, 1.0))
    torch.testing.assert_close(merge_from_cp(outs, seq_dim=2), full, rtol=0, atol=1e-6)
    # packed: two sequences (10 + 6 tokens) attend only within themselves
    cu = torch.tensor([0, 10, 16])
    packed = eager_attention(q, k, v, segment_mask(cu, s, q.device), 0.3, 1.0)  # True = may attend
    first = eager_attention(
        q[:, :, :10], k[:, :, :10], v[:, :, :10], allowed_mask(torch.arange(10), torch.arange(10), True, None), 0.3, 1.0
    )
    second = eager_attention(
        q[:, :, 10:], k[:, :, 10:], v[:, :, 10:], allowed_mask(torch.arange(6), torch.arange(6), True, None), 0.3, 1.0
    )
    torch.testing.assert_close(packed, torch.cat([first, second], dim=2), rtol=0, atol=1e-6)


def test_geglu_activation_is_transformers_gelu_pytorch_tanh(tmp_path):
    from transformers.activations import ACT2FN

    spec = load_spec(make_tiny("gemma2", tmp_path / "g2"))
    x = torch.randn(64) * 3
    assert torch.equal(activation_func(spec)(x), ACT2FN["gelu_pytorch_tanh"](x))
    assert activation_func(spec.replace(activation="silu")) is torch.nn.functional.silu


class _Out(torch.nn.Module):
    def forward(self, x):
        return x, None


def test_logits_cap_keeps_vocab_padding_minus_inf():
    layer = _Out()
    layer.register_forward_hook(lambda _m, _i, o: (o[0].masked_fill(torch.arange(6) >= 4, float("-inf")), o[1]))
    chunk = torch.nn.Module()
    chunk.output_layer = layer
    scale_and_cap_logits(chunk, divide_by=2.0, cap=0.5)
    x = torch.randn(3, 6) * 4
    got, _ = chunk.output_layer(x)
    assert torch.isinf(got[:, 4:]).all() and (got[:, 4:] < 0).all()
    torch.testing.assert_close(got[:, :4], 0.5 * torch.tanh(x[:, :4] / 2.0 / 0.5), rtol=0, atol=0)


def test_embedding_multiplier_rounds_like_transformers_in_bf16():
    """Gemma multiplies by sqrt(hidden) cast to the hidden dtype: 55.4256 -> 55.5 in bf16."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2TextScaledWordEmbedding

    hf = Gemma2TextScaledWordEmbedding(10, 3072, padding_idx=0, embed_scale=3072**0.5).to(torch.bfloat16)
    emb = torch.nn.Embedding(10, 3072).to(torch.bfloat16)
    emb.weight.data.copy_(hf.weight.data)
    chunk = torch.nn.Module()
    chunk.embedding = emb
    scale_embedding(chunk, 3072**0.5)
    ids = torch.arange(10).unsqueeze(0)
    assert torch.equal(chunk.embedding(ids), hf(ids))


def test_zero_centred_norm_equals_gemma_rmsnorm():
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    from megatron_bridge.runtime.blocks.norms import BridgeRMSNorm

    hf = Gemma3RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(hf.weight)
    cfg = SimpleNamespace(params_dtype=torch.float32, sequence_parallel=False)
    mine = BridgeRMSNorm(cfg, 16, eps=1e-6)
    mine.weight.data.copy_(hf.weight.data)
    x = torch.randn(5, 16).to(torch.bfloat16)
    assert torch.equal(mine(x), hf(x))


def test_family_configs_round_trip_and_refusals(tmp_path):
    g2 = load_spec(make_tiny("gemma2", tmp_path / "g2"))
    assert g2.zero_centered_norm and g2.post_attention_norm and g2.post_mlp_norm and g2.activation == "gelu_tanh"
    assert g2.window_pattern == (1, 0, 1, 0) and g2.head_dim == 16 and g2.softmax_scale == 24**-0.5
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.embedding_multiplier) == (0.5, 0.5, 32**0.5)
    cfg = spec_to_hf_config(g2.replace(attn_logit_softcapping=None, final_logit_softcapping=None))
    assert cfg["query_pre_attn_scalar"] == 24 and cfg["attn_logit_softcapping"] is None  # Gemma 2 defaults it on
    gr = load_spec(make_tiny("granite", tmp_path / "gr"))
    assert (gr.embedding_multiplier, gr.softmax_scale, gr.residual_multiplier, gr.logits_scaling) == (12, 0.3, 0.22, 4)
    g3 = load_spec(make_tiny("gemma3_text", tmp_path / "g3"))
    assert g3.qk_layernorm and g3.zero_centered_norm and (g3.rotary_base, g3.rope_local_base) == (1e6, 1e4)
    hf3 = spec_to_hf_config(g3)
    assert hf3["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert hf3["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    for spec in (g2, gr, g3):
        assert spec_from_hf(spec_to_hf_config(spec)) == spec
    # v4-style Gemma 3 config: rope_theta 1e6 and rope_local_base_freq 1e4 (the real models)
    v4 = {k: v for k, v in hf3.items() if k != "rope_parameters"}
    assert spec_from_hf({**v4, "rope_theta": 1e6, "rope_local_base_freq": 1e4}) == g3
    same = spec_from_hf({**v4, "rope_theta": 1e4, "rope_local_base_freq": 1e4})
    assert (same.rotary_base, same.rope_local_base) == (1e4, None)
    with pytest.raises(UserError, match="bidirectional"):
        spec_from_hf({**hf3, "use_bidirectional_attention": True})
    with pytest.raises(UserError, match="gelu_new"):
        spec_from_hf({**hf3, "hidden_activation": "gelu_new"})


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_gemma3_reads_language_model_prefixed_checkpoints(tmp_path, prefix):
    path = make_tiny("gemma3_text", tmp_path / "g3")
    spec = load_spec(path)
    keys = HFCheckpoint(path).keys()
    moved = [prefix + k[len("model.") :] for k in keys]
    plain = {r.megatron: r.hf for r in resolve_checkpoint(spec, keys)}
    other = {r.megatron: r.hf for r in resolve_checkpoint(spec, moved)}
    assert plain.keys() == other.keys()  # every tensor consumed (resolve_checkpoint refuses leftovers)
    for name, hf in plain.items():
        assert other[name] == tuple(prefix + h[len("model.") :] for h in hf), name


@pytest.fixture
def one_process_groups():
    """megatron-core's groups for one process (gloo), torn down and env restored after."""
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        yield


def test_gemma2_packed_sequences_equal_transformers_per_sequence(tmp_path, one_process_groups):
    """Two sequences packed in one THD row through the built Gemma 2 (soft-capped attention on
    alternating sliding layers): each one's logits are transformers' on it alone."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.packing import packed_seq_params
    from megatron_bridge.runtime.weights import load_hf_weights

    path = make_tiny("gemma2", tmp_path / "g2")
    spec = load_spec(path, make_vocab_size_divisible_by=8)
    (chunk,) = build_model(spec, Layout())
    load_hf_weights([chunk], spec, path)
    chunk.eval()
    lengths = (11, 7)
    ids = torch.randint(0, spec.vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    with torch.no_grad():
        got = chunk(ids, pos, None, packed_seq_params=packed_seq_params(seg))[..., : spec.vocab_size]
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        want = torch.cat([hf(part).logits for part in ids.split(list(lengths), dim=1)], dim=1)
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family, cls", [("gemma2", "Gemma2Config"), ("gemma3_text", "Gemma3TextConfig")])
def test_pre_v5_gemma_configs_get_transformers_default_layer_types(family, cls):
    """Hub configs written before transformers 5 have no layer_types and a stale hidden_act;
    the window pattern is the one transformers' config class derives."""
    import transformers

    from megatron_bridge.bridge.registry import get_family

    arch = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}[family]
    hf = dict(
        architectures=[arch],
        model_type=family,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=100,
        sliding_window=8,
        hidden_act="gelu",  # Gemma reads hidden_activation
        hidden_activation="gelu_pytorch_tanh",
        rope_theta=10000.0,
        rope_local_base_freq=10000.0,
        sliding_window_pattern=3,  # Gemma 3 only
    )
    want = getattr(transformers, cls)(**{k: v for k, v in hf.items() if k != "architectures"}).layer_types
    assert get_family(family).complete_hf(hf)["layer_types"] == want
    spec = spec_from_hf(hf)
    assert spec.window_pattern == tuple(int(t == "sliding_attention") for t in want) and spec.activation == "gelu_tanh"
