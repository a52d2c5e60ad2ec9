"""GPT-OSS building blocks against transformers' own functions: the stacked / transposed /
interleaved expert tensors (stacked.ExpertsStacked), learned attention sinks in our core
attention (vs `eager_attention_forward` of modeling_gpt_oss), the clamped SwiGLU config
(vs `GptOssExperts._apply_gate`), and the refusals that go with them."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from megatron_bridge.bridge.hf_config import spec_from_hf
from megatron_bridge.bridge.mapping import GATE_UP, REPLICATED, ROW
from megatron_bridge.bridge.shards import Block, Shapes, Shard
from megatron_bridge.bridge.stacked import ExpertsStacked
from megatron_bridge.errors import UserError

SHAPES = Shapes(4, 2, 8, 250, 256)
E, HID, INTER = 3, 6, 4


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_stacked_gate_up_is_hf_gate_and_up_for_every_expert_and_split():
    w = torch.randn(E, HID, 2 * INTER, generator=_g())
    b = torch.randn(E, 2 * INTER, generator=_g(1))
    x = torch.randn(5, HID, generator=_g(2))
    t = ExpertsStacked(GATE_UP, "gate_up")
    for e in range(E):
        fc1 = t.shard([w[e : e + 1]], Shard(0, 1), SHAPES)  # megatron [gate; up] rows, nn.Linear layout
        bias = t.shard([b[e : e + 1]], Shard(0, 1), SHAPES)
        # HF: gate_up = x @ W[e] + b, gate = [..., ::2], up = [..., 1::2]; megatron: x @ fc1.T + bias
        assert torch.equal(fc1[:INTER], w[e][:, ::2].T) and torch.equal(fc1[INTER:], w[e][:, 1::2].T)
        assert torch.equal(bias[:INTER], b[e][::2]) and torch.equal(bias[INTER:], b[e][1::2])
        gate_up, ours = x @ w[e] + b[e], x @ fc1.T + bias
        assert torch.allclose(ours, torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1), atol=1e-6)
        for n in (1, 2, 4):
            parts = [t.shard([w[e : e + 1]], Shard(r, n), SHAPES) for r in range(n)]
            assert all(p.shape == (2 * INTER // n, HID) for p in parts)
            assert torch.equal(t.merge(parts, SHAPES)[0], w[e : e + 1])
            bparts = [t.shard([b[e : e + 1]], Shard(r, n), SHAPES) for r in range(n)]
            assert torch.equal(t.merge(bparts, SHAPES)[0], b[e : e + 1])


def test_stacked_down_is_transposed_linear():
    w = torch.randn(E, INTER, HID, generator=_g())
    b = torch.randn(E, HID, generator=_g(1))
    h = torch.randn(5, INTER, generator=_g(2))
    down, same = ExpertsStacked(ROW, "linear"), ExpertsStacked(REPLICATED, "same")
    for e in range(E):
        fc2 = down.shard([w[e : e + 1]], Shard(0, 1), SHAPES)
        assert torch.equal(fc2, w[e].T) and torch.allclose(h @ fc2.T, h @ w[e], atol=1e-6)
        parts = [down.shard([w[e : e + 1]], Shard(r, 2), SHAPES) for r in range(2)]
        assert parts[0].shape == (HID, INTER // 2)
        assert torch.equal(down.merge(parts, SHAPES)[0], w[e : e + 1])
        assert torch.equal(same.merge([same.shard([b[e : e + 1]], Shard(0, 1), SHAPES)], SHAPES)[0], b[e : e + 1])


def test_stacked_experts_are_strided_blocks_of_the_slab():
    """What the offline byte copier gathers: gate = the slab's even columns, up = its odd
    ones (transposed, step 2), down = the slab transposed, its bias the slab itself."""
    gate_up = ExpertsStacked(GATE_UP, "gate_up").blocks([(1, HID, 2 * INTER)], Shard(1, 2), SHAPES)
    assert gate_up == [
        Block(0, (INTER, 2 * INTER), step=2, transposed=True, lead=1),
        Block(0, (INTER + 1, 2 * INTER + 1), step=2, transposed=True, lead=1),
    ]
    assert ExpertsStacked(ROW, "linear").blocks([(1, INTER, HID)], Shard(0, 2), SHAPES) == [
        Block(0, (0, HID), (0, INTER // 2), transposed=True, lead=1)
    ]
    assert ExpertsStacked(REPLICATED, "same").blocks([(1, HID)], Shard(0, 2), SHAPES) == [Block(0, (0, HID), lead=1)]
    with pytest.raises(ValueError, match="one expert's slab"):
        ExpertsStacked(GATE_UP, "gate_up").blocks([(E, HID, 2 * INTER)], Shard(0, 1), SHAPES)


def test_clamped_glu_config_matches_hf_apply_gate():
    from megatron_bridge.runtime.blocks.glu import ClampedGLUBlock

    spec = types.SimpleNamespace(glu_clamp=7.0, glu_alpha=1.702, glu_linear_offset=1.0)
    kw: dict = {}
    ClampedGLUBlock.config(spec, kw)
    assert kw["activation_func"].keywords == {"alpha": 1.702}
    x = 6 * torch.randn(7, 2 * INTER, generator=_g())  # reaches the clamp
    experts = types.SimpleNamespace(limit=7.0, alpha=1.702)
    want = hf.GptOssExperts._apply_gate(experts, x)
    # megatron's unfused GLU (MLP.forward) on the same values in its [gate; up] layout
    g, u = x[..., ::2].clamp(max=kw["activation_func_clamp_value"]), x[..., 1::2]
    v = kw["activation_func_clamp_value"]
    got = kw["activation_func"](g) * (u.clamp(-v, v) + kw["glu_linear_offset"])
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    if not torch.distributed.is_initialized():
        f = tmp_path_factory.mktemp("pg") / "store"
        torch.distributed.init_process_group("gloo", init_method=f"file://{f}", rank=0, world_size=1)
    return torch.distributed.group.WORLD


def _attention(world, window=None, heads=4, groups=2, d=8):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bridge.runtime.cp_attention import ContextParallelAttention

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=heads * d,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=d,
        softmax_type="learnable",
        use_cpu_initialization=True,
    )
    cls = ContextParallelAttention
    pgs = types.SimpleNamespace(cp=None, tp=world)
    att = cls(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgs, window=window).eval()
    with torch.no_grad():
        att.softmax_offset.copy_(torch.randn(heads, generator=_g(5)) * 2)
    return att


def _hf_eager(att, q, k, v, mask):
    """transformers' GPT-OSS eager attention on [b, h, s, d] tensors -> [s, b, h·d]."""
    module = types.SimpleNamespace(sinks=att.softmax_offset.detach(), num_key_value_groups=q.shape[1] // k.shape[1])
    module.training = False
    out, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=att.softmax_scale)
    return out.permute(1, 0, 2, 3).reshape(q.shape[2], q.shape[0], -1)


def _mask(s, window=None):
    i = torch.arange(s)
    ok = i[:, None] >= i[None, :]
    if window:
        ok &= (i[:, None] - i[None, :]) < window
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("window", [None, 4])
def test_sink_attention_matches_transformers_eager(world, window):
    att = _attention(world, window=(window - 1, 0) if window else None)
    s, b = 10, 2
    q = torch.randn(s, b, 4, 8, generator=_g(1))
    k = torch.randn(s, b, 2, 8, generator=_g(2))
    v = torch.randn(s, b, 2, 8, generator=_g(3))
    got = att(q, k, v)
    want = _hf_eager(att, q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), _mask(s, window))
    assert (got - want).abs().max() < 1e-6
    # the sink matters: without it (or with another value) the output differs
    with torch.no_grad():
        att.softmax_offset.fill_(-30.0)
    assert (att(q, k, v) - got).abs().max() > 1e-3


def test_sink_attention_packed_sequences_is_per_sequence(world):
    from megatron.core.packed_seq_params import PackedSeqParams

    att = _attention(world)
    lens = [3, 5]
    t = sum(lens)
    q = torch.randn(t, 4, 8, generator=_g(1))
    k = torch.randn(t, 2, 8, generator=_g(2))
    v = torch.randn(t, 2, 8, generator=_g(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    p = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    got = att(q, k, v, packed_seq_params=p)
    for a, n in zip((0, 3), lens):
        sl = slice(a, a + n)
        want = _hf_eager(att, *(x[sl].unsqueeze(0).permute(0, 2, 1, 3) for x in (q, k, v)), _mask(n))
        assert (got[sl] - want).abs().max() < 1e-6


def test_sink_gradient_reaches_the_parameter(world):
    att = _attention(world)
    q, k, v = (torch.randn(6, 1, h, 8, generator=_g(i)) for i, h in ((1, 4), (2, 2), (3, 2)))
    att(q, k, v).square().sum().backward()
    assert att.softmax_offset.grad is not None and att.softmax_offset.grad.abs().min() > 0
    assert getattr(att.softmax_offset, "tensor_model_parallel", False)


def _llama(**kw):
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    return {**cfg, **kw}


def test_partial_biases_are_refused_all_biases_accepted():
    with pytest.raises(UserError, match="o_proj bias"):
        spec_from_hf(_llama(attention_bias=True))
    with pytest.raises(UserError, match="mlp_bias"):
        spec_from_hf(_llama(mlp_bias=True))
    s = spec_from_hf(_llama(attention_bias=True, mlp_bias=True))
    assert s.add_qkv_bias and s.attention_out_bias and s.mlp_bias


def test_gpt_oss_spec_and_megatron_config():
    from megatron_bridge.bridge.features.attention import needs_own_attention
    from megatron_bridge.bridge.hf_config import spec_to_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.tconfig import transformer_config
    from megatron_bridge.runtime.tiny import tiny_config

    s = spec_from_hf(tiny_config("gpt_oss").to_dict())
    assert s.attention_sinks and s.mlp_bias and s.moe_router_bias and s.attention_out_bias and s.add_qkv_bias
    assert (s.glu_clamp, s.glu_alpha, s.glu_linear_offset) == (0.2, 1.702, 1.0)
    assert s.window_pattern == (1, 0, 1, 0) and not s.moe_router_pre_softmax
    assert spec_from_hf(spec_to_hf_config(s)) == s
    assert "attention sinks" in needs_own_attention(s)
    tc = transformer_config(s, Layout(ep=2))
    assert tc.softmax_type == "learnable" and tc.add_bias_linear and tc.activation_func_clamp_value == 0.2
    assert tc.glu_linear_offset == 1.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megatron_bridge.runtime.tiny import make_tiny

    return make_tiny("gpt_oss", tmp_path_factory.mktemp("tiny") / "gpt_oss")


def test_offline_convert_checks_gpt_oss_shapes(tiny):
    """The converter's shape checks run on the stacked tensors (one expert's slab each)."""
    from safetensors import safe_open

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.convert.sources.rows import resolve_rows

    path = tiny
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    spec = load_spec(path)
    rows = resolve_rows(spec, tensors)
    assert sum(r.mapping.transform.stacked for r in rows) == 4 * spec.num_moe_experts * spec.num_layers
    key = next(k for k in tensors if k.endswith("experts.down_proj"))
    (e, *rest), dtype = tensors[key]
    with pytest.raises(UserError, match="not .* stacked experts"):
        resolve_rows(spec, {**tensors, key: ((e + 1, *rest), dtype)})


def test_biased_experts_need_etp1(tiny):
    from megatron_bridge.backends.describe import describe
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.config.schema import Config
    from megatron_bridge.parallel.rules.registry import check_all

    cfg = Config()
    cfg.train.seq_length = 32
    spec = describe(cfg.model, hf_path=tiny)

    def rules(layout, world):
        return [v.rule for v in check_all(layout.with_world(world), spec, cfg, layout_only=True)[0]]

    assert "moe-bias-etp" in rules(Layout(tp=2, ep=2), 4)
    assert rules(Layout(tp=2, ep=2, etp=1), 4) == [] and rules(Layout(ep=2), 2) == []
