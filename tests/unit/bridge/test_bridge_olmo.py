"""OLMo-2 / OLMoE / Qwen3-MoE building blocks without processes: the full-projection qk-norm
against transformers' norm, which heads a TP rank holds, the q/k/v clamp, and what the
layer specs of each family are made of (the parity runs are `mbr verify`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_bridge.bridge.hf_config import spec_from_hf
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.registry import get_family
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.blocks.qk_norm import FullQKNorm, clipped_attention_class
from megatron_bridge.runtime.layer_specs import all_layer_specs
from megatron_bridge.runtime.tconfig import transformer_config
from megatron_bridge.runtime.tiny import tiny_config


def _cfg(tp: int = 1, heads: int = 4, kv: int = 2):
    return SimpleNamespace(
        tensor_model_parallel_size=tp, num_attention_heads=heads, num_query_groups=kv, params_dtype=torch.float32
    )


@pytest.mark.parametrize("which,heads", [("q", 4), ("k", 2)])
def test_full_qk_norm_is_transformers_norm_over_the_projection(which, heads):
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    d = 8
    ours = FullQKNorm(_cfg(), hidden_size=d, eps=1e-6, which=which)
    ref = Olmo2RMSNorm(heads * d, eps=1e-6)
    w = torch.randn(heads * d)
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = torch.randn(5, 3, heads, d)  # megatron's [sq, b, heads, head_dim]
    want = ref(x.reshape(5, 3, heads * d)).reshape(5, 3, heads, d)
    torch.testing.assert_close(ours(x), want, rtol=1e-6, atol=1e-6)
    # a per-head norm would differ: the mean of squares runs over every head
    per_head = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.view(heads, d)
    assert not torch.allclose(want, per_head, atol=1e-3)


@pytest.mark.parametrize(
    "tp,kv,which,want",
    [
        (2, 2, "q", [(0, 2, 1), (2, 2, 1)]),
        (2, 2, "k", [(0, 1, 1), (1, 1, 1)]),
        (4, 2, "q", [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)]),
        (4, 2, "k", [(0, 1, 2), (0, 1, 2), (1, 1, 2), (1, 1, 2)]),  # kv < tp: megatron copies a group
    ],
)
def test_full_qk_norm_heads_of_each_tp_rank(monkeypatch, tp, kv, which, want):
    from megatron.core import parallel_state as ps

    norm = FullQKNorm(_cfg(tp=tp, kv=kv), hidden_size=8, which=which)
    assert norm.weight.shape == ((4 if which == "q" else kv) * 8,)  # the whole weight on every rank
    got = []
    for r in range(tp):
        monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda r=r: r)
        got.append(norm.local_heads())
    assert got == want


def test_clip_qkv_clamps_q_k_v_after_the_base():
    class Base(torch.nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def get_query_key_value_tensors(self, x):
            return x * self.scale, -x * self.scale, x

    cls = clipped_attention_class(Base)
    assert cls is clipped_attention_class(Base) and issubclass(cls, Base)
    m = cls(3.0, clip_qkv=1.5)
    q, k, v = m.get_query_key_value_tensors(torch.tensor([-1.0, 0.2, 1.0]))
    assert q.tolist() == [-1.5, 0.6000000238418579, 1.5] and k.tolist() == [1.5, -0.6000000238418579, -1.5]
    assert v.tolist() == [-1.0, 0.2, 1.0] or torch.allclose(v, torch.tensor([-1.0, 0.2, 1.0]))


def test_tiny_olmoe_clip_is_live_and_read():
    """The tiny OLMoE's clip_qkv changes transformers' output (so verify exercises it)."""
    from transformers import AutoModelForCausalLM

    from megatron_bridge.runtime.tiny import randomize_

    ids = torch.randint(0, 250, (1, 16), generator=torch.Generator().manual_seed(0))
    out = []
    for clip in (1.0, None):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(tiny_config("olmoe", clip_qkv=clip))
        randomize_(m)
        out.append(m(ids).logits)
    assert (out[0] - out[1]).abs().max() > 1e-3
    assert spec_from_hf(tiny_config("olmoe").to_dict()).clip_qkv == 1.0
    with pytest.raises(UserError, match="clip_qkv"):
        spec_from_hf({**tiny_config("olmoe").to_dict(), "clip_qkv": -1.0})


def _layers(fam: str):
    spec = spec_from_hf(tiny_config(fam).to_dict())
    return spec, all_layer_specs(spec, transformer_config(spec, Layout()))


def test_olmo2_layer_specs_norm_the_sublayer_outputs():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP

    spec, layers = _layers("olmo2")
    assert (spec.pre_norms, spec.post_attention_norm, spec.post_mlp_norm, spec.qk_norm_type) == (
        False,
        True,
        True,
        "full",
    )
    for layer in layers:
        sub = layer.submodules
        assert sub.input_layernorm is IdentityOp and sub.pre_mlp_layernorm is IdentityOp
        assert issubclass(sub.self_attention.module, SelfAttention) and sub.self_attention.module is not SelfAttention
        assert issubclass(sub.mlp.module, MLP) and sub.mlp.module is not MLP
        qn, kn = sub.self_attention.submodules.q_layernorm, sub.self_attention.submodules.k_layernorm
        assert qn.module is FullQKNorm and (qn.params, kn.params) == ({"which": "q"}, {"which": "k"})
    names = {m.megatron for m in get_family("olmo2").mappings(spec)}
    assert "decoder.layers.{layer}.mlp.post_layernorm.weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


def test_olmoe_and_qwen3_moe_layer_specs():
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec, layers = _layers("olmoe")
    assert spec.moe_router_pre_softmax and spec.moe_layer_pattern == ()
    for layer in layers:
        attn = layer.submodules.self_attention
        assert issubclass(attn.module, SelfAttention) and attn.params["clip_qkv"] == 1.0
        assert attn.submodules.q_layernorm.module is FullQKNorm
        assert layer.submodules.mlp.module is MoELayer

    spec, layers = _layers("qwen3_moe")
    assert spec.qk_norm_type == "head" and not spec.moe_router_pre_softmax and spec.clip_qkv is None
    assert spec.moe_layer_pattern == (1, 0, 1, 1) and spec.sliding_window == 8
    assert [layer.submodules.mlp.module is MoELayer for layer in layers] == [True, False, True, True]
    for layer in layers:
        attn = layer.submodules.self_attention
        assert attn.module is SelfAttention and attn.submodules.q_layernorm is not FullQKNorm


def test_wrapped_sublayers_get_their_base_constructor_arguments():
    """TransformerLayer picks an MLP's kwargs by `spec.module in (MoELayer, ...)` / `== MLP`:
    a post-processed MLP / MoELayer must pass those checks (no 'Unknown MLP type')."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_bridge.runtime.blocks.norms import norm_module
    from megatron_bridge.runtime.blocks.sublayer import post_processed

    spec = spec_from_hf(tiny_config("olmo2").to_dict())
    mlp, moe = post_processed(MLP, norm_module(spec)), post_processed(MoELayer, None)
    assert mlp == MLP and mlp is not MLP and issubclass(mlp, MLP) and mlp != MoELayer
    assert moe in (MoELayer, SequentialMLP) and moe != MLP and MLP == mlp
    assert len({mlp, MLP, moe, MoELayer}) == 4  # hashing stays by identity
