"""Parameter counts of the planner (megatron_bridge.plan.params) against real models.

1. Published sizes of the shipped model groups (Llama 3 8B/70B/405B, Mixtral 8x7B total and
   active, GPT-3 175B, the 1T GPT of Narayanan et al.).
2. `sum(p.numel())` of real Hugging Face models built in-process on CPU (tiny configs of
   Llama with GQA, tied and untied; Qwen2 with QKV bias; Qwen3 with QK-norm; Mixtral;
   Qwen2-MoE with a gated shared expert; GPT-2 for the GPT family: LayerNorm, biases,
   learned positions, tied output layer).
3. Per-rank shards at tp2·pp2: the tiny HF Llama's tensors are sliced exactly as
   megatron-core shards them (QKV/fc1/gate/up column-parallel over TP, output projection
   and fc2 row-parallel, embedding and output layer vocab-parallel after padding the
   vocabulary to a multiple of make_vocab_size_divisible_by·tp, norms replicated; layers
   split evenly over the stages, embedding on the first stage, final norm and output layer
   on the last, and with tied embeddings a copy of the embedding on the last stage); the
   planner's per-rank parameter count and its weight/gradient/optimizer bytes are compared
   with the bytes of real bf16 weights, bf16 gradients and an fp32 master copy with real
   torch.optim.Adam states (exp_avg, exp_avg_sq) built for each rank — and with ZeRO-1 over
   dp=2, with the Adam states of each rank's half of the flattened fp32 buffer.
"""

import pytest

from megatron_bridge.backends.describe import describe, describe_hf
from megatron_bridge.bridge.hf_config import UnsupportedFeatures
from megatron_bridge.config.compose import compose
from megatron_bridge.config.schema import ModelConfig
from megatron_bridge.plan import memory as M
from megatron_bridge.plan import params as P


@pytest.mark.parametrize(
    "model,total,active",
    [
        ("llama3_8b", 8_030_261_248, 8_030_261_248),
        ("llama3_70b", 70_553_706_496, 70_553_706_496),
        ("llama3_405b", 405_853_388_800, 405_853_388_800),
        ("mixtral_8x7b", 46_702_792_704, 12_879_925_248),
        ("gpt3_175b", 174_615_846_912, 174_615_846_912),  # 175B with biases, tied, learned positions
        ("gpt_1t", 1_008_038_758_400, 1_008_038_758_400),
    ],
)
def test_published_sizes(model, total, active):
    cfg, _ = compose([f"model={model}"])
    c = P.count(describe(cfg.model))
    assert (c.total, c.active) == (total, active)


def _hf_model(kind, **kw):
    import torch
    import transformers as T

    torch.manual_seed(0)
    base = dict(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    base.update(kw)
    cls = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM),
        "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM),
    }[kind]
    hf_cfg = cls[0](**base)
    return hf_cfg, cls[1](hf_cfg)


def _model_config(hf_cfg, **extra):
    """The description of an HF config (as `model.hf_path` gives it)."""
    return describe_hf(hf_cfg.to_dict(), **extra)


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 16}),
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        (
            "qwen2_moe",
            {
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48,
            },
        ),
    ],
)
def test_count_equals_hf_numel(kind, kw):
    hf_cfg, model = _hf_model(kind, **kw)
    mc = _model_config(hf_cfg)
    assert P.count(mc).total == sum(p.numel() for p in model.parameters())


def test_count_equals_gpt2_numel():
    """GPT family = GPT-2's layout: LayerNorm with bias, biases on all linears, learned
    positions, GeLU MLP, output layer tied to the embedding."""
    import transformers as T

    hf = T.GPT2Config(vocab_size=500, n_positions=128, n_embd=64, n_layer=3, n_head=4, n_inner=256)
    model = T.GPT2LMHeadModel(hf)
    mc = ModelConfig(
        family="gpt",
        num_layers=3,
        hidden_size=64,
        ffn_hidden_size=256,
        num_attention_heads=4,
        vocab_size=500,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        gated_linear_unit=False,
        normalization="LayerNorm",
        add_bias_linear=True,
        position_embedding_type="learned_absolute",
    )
    assert P.count(describe(mc)).total == sum(p.numel() for p in model.parameters())


# -- per-rank shards -----------------------------------------------------------------------
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output dim split over TP
ROW = ("o_proj", "down_proj")  # input dim split over TP
VOCAB = ("embed_tokens", "lm_head")


def _megatron_shard(name, w, tp, rank, padded_vocab):
    """The slice of HF tensor `name` that megatron-core's TP rank `rank` holds."""
    import torch

    if any(k in name for k in VOCAB):
        w = torch.cat([w, w.new_zeros(padded_vocab - w.shape[0], w.shape[1])])
        return w.chunk(tp, dim=0)[rank]
    if any(k in name for k in COLUMN):
        return w.chunk(tp, dim=0)[rank]
    if any(k in name for k in ROW):
        return w.chunk(tp, dim=1)[rank]
    return w  # norms: replicated


def _rank_tensors(model, mc, tp, pp, tp_rank, pp_rank):
    from megatron_bridge.parallel.dims import padded_vocab_size

    L = mc.num_layers
    per = L // pp
    layers = range(pp_rank * per, (pp_rank + 1) * per)
    padded = padded_vocab_size(mc.vocab_size, mc.make_vocab_size_divisible_by, tp)
    named = dict(model.named_parameters())
    if mc.tie_word_embeddings:
        named.setdefault("lm_head.weight", named["model.embed_tokens.weight"])
    out = []
    for name, w in named.items():
        if ".layers." in name:
            keep = int(name.split(".layers.")[1].split(".")[0]) in layers
        elif "embed_tokens" in name:
            keep = pp_rank == 0
        elif name == "lm_head.weight":
            # untied: the output layer lives on the last stage; tied: the last stage keeps a
            # copy of the embedding unless it is also the first stage.
            keep = pp_rank == pp - 1 and (not mc.tie_word_embeddings or pp > 1)
        else:  # model.norm
            keep = pp_rank == pp - 1
        if keep:
            out.append(_megatron_shard(name, w.detach(), tp, tp_rank, padded))
    return out


def _real_state_bytes(shards, dp=1, dp_rank=0):
    """Bytes of bf16 weights, bf16 grads, and fp32 master + Adam states (ZeRO-1: of this
    dp rank's slice of the flattened fp32 buffer), built for real and stepped once."""
    import torch

    weights = [s.to(torch.bfloat16) for s in shards]
    grads = [torch.ones_like(w) for w in weights]
    flat = torch.cat([s.float().reshape(-1) for s in shards])
    assert flat.numel() % dp == 0
    master = flat.chunk(dp)[dp_rank].clone().requires_grad_(True)
    master.grad = torch.ones_like(master)
    opt = torch.optim.Adam([master], lr=1e-3)
    opt.step()
    st = opt.state[master]
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return {
        "params": sum(s.numel() for s in shards),
        "weights": nbytes(weights),
        "grads": nbytes(grads),
        "optimizer": nbytes([master, st["exp_avg"], st["exp_avg_sq"]]),
    }


@pytest.mark.parametrize("tied", [False, True])
def test_rank_shards_tp2_pp2_match_real_tensors(tied):
    hf_cfg, model = _hf_model("llama", tie_word_embeddings=tied)
    mc = _model_config(hf_cfg, make_vocab_size_divisible_by=64)  # vocab 500 -> 512 at tp2
    tp, pp, L = 2, 2, mc.num_layers
    for pp_rank in range(pp):
        first, last = pp_rank == 0, pp_rank == pp - 1
        planner = P.rank_params(mc, tp=tp, ep=1, etp=tp, layers=L // pp, first=first, last=last)
        for tp_rank in range(tp):
            shards = _rank_tensors(model, mc, tp, pp, tp_rank, pp_rank)
            real = _real_state_bytes(shards)
            assert planner["dense"] + planner["expert"] == real["params"]
            st = M.model_states(
                planner["dense"],
                planner["expert"],
                engine="megatron",
                precision="bf16",
                zero=0,
                dp_shard=1,
                edp_shard=1,
            )
            assert (st.weights, st.grads, st.optimizer) == (real["weights"], real["grads"], real["optimizer"])
            # ZeRO-1 (megatron's DistributedOptimizer) over dp=2: each rank keeps the fp32
            # master and Adam states of half the flattened buffer.
            st1 = M.model_states(
                planner["dense"],
                planner["expert"],
                engine="megatron",
                precision="bf16",
                zero=1,
                dp_shard=2,
                edp_shard=2,
            )
            for dp_rank in range(2):
                assert st1.optimizer == _real_state_bytes(shards, dp=2, dp_rank=dp_rank)["optimizer"]
            assert (st1.weights, st1.grads) == (real["weights"], real["grads"])


def test_rank_params_sum_over_ranks_is_the_padded_model():
    """Summed over all TP ranks and stages, the shards are the whole model with megatron's
    padded vocabulary (replicated tensors counted once per TP rank)."""
    cfg, _ = compose(["model=llama3_70b"])
    m = describe(cfg.model)
    tp, pp, L = 8, 4, m.num_layers
    total = sum(P.rank_params(m, tp=tp, layers=L // pp, first=s == 0, last=s == pp - 1)["dense"] for s in range(pp))
    layer = P.layer_shards(m)
    replicated_extra = (tp - 1) * (layer.rep * L + m.hidden_size)  # norms on every TP rank; final norm
    padding = (129024 - 128256) * m.hidden_size * 2  # vocab -> multiple of 128·8, embedding + output layer
    assert total * tp == P.count(describe(cfg.model)).total + replicated_extra + padding


def test_largest_layer_is_the_vocab_shard_for_llama():
    cfg, _ = compose(["model=llama3_8b"])
    assert P.largest_layer(describe(cfg.model), tp=1) == 128256 * 4096
    assert P.largest_layer(describe(cfg.model), tp=8) == 129024 * 4096 / 8  # vocab padded to 128·8


def test_qkv_bias_fields_follow_the_bridge():
    """HF's attention_bias (q/k/v *and* o_proj biases) is refused by the bridge, not read as a
    qkv bias; Qwen2 has one implicitly, Qwen2-MoE says so with qkv_bias."""
    base = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    with pytest.raises(UnsupportedFeatures, match="o_proj bias"):
        describe_hf({**base, "model_type": "llama", "attention_bias": True})
    assert describe_hf({**base, "model_type": "qwen2"}).add_qkv_bias
    qwen2_moe = {**base, "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 32}
    assert not describe_hf({**qwen2_moe, "qkv_bias": False}).add_qkv_bias
