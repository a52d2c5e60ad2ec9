"""The planner's memory model (megatron_bridge.plan.memory) against closed forms and DeepSpeed.

- Activations: Korthikanti et al. 2022, Table 2, per layer and microbatch, for a GPT layer
  (ffn = 4h, multi-head attention): sbh(34 + 5as/h); with TP sbh(10 + 24/t + 5as/(ht));
  with TP+SP sbh/t·(34 + 5as/h); selective recompute drops 5as/h; full recompute 2sbh
  (2sbh/t with SP); CP replaces s by s/cp. 1F1B holds p microbatches on the first stage,
  interleaving multiplies that by (1 + (p−1)/(p·v)).
- Model states equal DeepSpeed 0.19.8's own estimators (`estimate_zero2_model_states_mem_needs`
  / `estimate_zero3_model_states_mem_needs`, which the `*_all_cold` functions print) for the
  same inputs at TP=PP=1, both for the state function and for a whole `mbr plan` run.
- The "medium-scale" rule of thumb (docs/plan.md): 4 weight-sized tensors (weights, grads, Adam m, v)
  per parameter; in fp32 that is 16 bytes, so 20B parameters fill a node of 8×40 GB.
"""

import contextlib
import io
import re

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.config.schema import ModelConfig
from megatron_bridge.plan import memory as M
from megatron_bridge.plan import params as P


def gpt(h=1024, a=16, L=4, V=1000):
    return describe(
        ModelConfig(
            family="gpt",
            num_layers=L,
            hidden_size=h,
            ffn_hidden_size=4 * h,
            num_attention_heads=a,
            vocab_size=V,
            max_position_embeddings=4096,
            gated_linear_unit=False,
            normalization="LayerNorm",
            add_bias_linear=True,
            position_embedding_type="learned_absolute",
            tie_word_embeddings=True,
        )
    )


SHAPES = [(2048, 1, 12288, 96), (2048, 4, 4096, 32), (8192, 1, 16384, 128), (512, 2, 1024, 16)]


@pytest.mark.parametrize("s,b,h,a", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 8])
def test_activations_closed_forms(s, b, h, a, t):
    m = gpt(h=h, a=a)
    sbh = s * b * h
    act = lambda rc, sp, cp=1: M.layer_activations(m, recompute=rc, s=s, b=b, t=t, sp=sp, cp=cp)  # noqa: E731
    if t == 1:
        assert act("none", False) == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert act("none", False) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert act("none", True) == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
    assert act("selective", False) == pytest.approx(sbh * (10 + 24 / t), rel=1e-12)
    assert act("selective", True) == pytest.approx(sbh / t * 34, rel=1e-12)
    assert act("full", False) == 2 * sbh
    assert act("full", True) == 2 * sbh / t
    # context parallelism: s -> s/cp everywhere (the a·s² term shrinks by cp², once per rank's chunk)
    sc = s // 4
    assert act("none", True, cp=4) == pytest.approx(sc * b * h / t * (34 + 5 * a * sc / h), rel=1e-12)


def test_activation_numbers_gpt3_175b():
    """GPT-3 175B, s=2048, b=1, t=8 with SP: 25.2M·(34+80)/8 bytes = 358.6 MB per layer;
    selective 107.0 MB; full 6.29 MB."""
    m = gpt(h=12288, a=96)
    assert M.layer_activations(m, recompute="none", s=2048, b=1, t=8, sp=True) == 2048 * 12288 * 114 / 8
    assert M.layer_activations(m, recompute="selective", s=2048, b=1, t=8, sp=True) == 2048 * 12288 * 34 / 8
    assert M.layer_activations(m, recompute="full", s=2048, b=1, t=8, sp=True) == 2 * 2048 * 12288 / 8


def test_swiglu_gqa_terms():
    """Llama layers: K/V are g·d wide, SwiGLU stores a 2·ffn-wide fc1 output and an ffn-wide
    fc2 input. Per layer without parallelism: replicated 10sbh, Q + proj 4sbh, K+V 4sb·g·d,
    MLP 2·3·sb·ffn bytes."""
    cfg, _ = compose(["model=llama3_8b"])
    m = describe(cfg.model)
    s, b, h, f, g, d = 4096, 1, 4096, 14336, 8, 128
    expect = s * b * (10 * h + 4 * h + 4 * g * d + 6 * f)
    assert M.layer_activations(m, recompute="selective", s=s, b=b) == expect


@pytest.mark.parametrize("p,v", [(4, 1), (8, 1), (8, 2), (16, 3), (64, 2)])
def test_in_flight_first_stage(p, v):
    m = 4 * p  # plenty of microbatches
    expect = p if v == 1 else p * (1 + (p - 1) / (p * v))
    assert M.in_flight(0, p, m, v) == pytest.approx(expect)
    assert M.in_flight(p - 1, p, m, 1) == 1  # the last stage runs each microbatch straight back
    assert M.in_flight(0, p, 2, 1) == 2  # never more than the step's microbatches


def test_first_stage_holds_L_layers_worth_whatever_pp():
    """1F1B: stage 0 holds p microbatches of L/p layers = L layers' activations, so PP does
    not reduce activation memory (only TP/SP, CP and recompute do)."""
    m = gpt(h=4096, a=32, L=32)
    per = M.layer_activations(m, recompute="selective", s=2048, b=1, t=8, sp=True)
    for p in (2, 4, 8, 16):
        sm = M.stage_memory(
            m,
            stage=0,
            p=p,
            layers=32 // p,
            first=True,
            last=False,
            tp=8,
            cp=1,
            ep=1,
            etp=8,
            dp=1,
            edp=1,
            zero=0,
            engine="megatron",
            precision="bf16",
            recompute="selective",
            sp=True,
            s=2048,
            b=1,
            num_micro=64,
            vocab=1024,
        )
        embedding_mask = p * 2048 * 4096 / 8
        assert sm.activations == pytest.approx(32 * per + embedding_mask)


# -- DeepSpeed's estimators ------------------------------------------------------------------
def _ds():
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    return stage_1_and_2, stage3


def _planner_states(model, zero, nodes, gpn):
    cfg, _ = compose([f"model={model}"])
    m = describe(cfg.model)
    rp = P.rank_params(m, tp=1, layers=m.num_layers, first=True, last=True)
    n = nodes * gpn
    ll = P.largest_layer(m, tp=1)
    st = M.model_states(
        rp["dense"],
        rp["expert"],
        engine="deepspeed",
        precision="bf16",
        zero=zero,
        dp_shard=n,
        edp_shard=n,
        largest_layer=ll if zero == 3 else 0,
    )
    return rp["dense"] + rp["expert"], ll, st.total


@pytest.mark.parametrize("model", ["llama3_8b", "llama3_70b", "mixtral_8x7b", "tiny_llama"])
@pytest.mark.parametrize("nodes,gpn", [(1, 1), (1, 8), (4, 8), (16, 8)])
def test_zero2_zero3_equal_deepspeed_estimators(model, nodes, gpn):
    s12, s3 = _ds()
    total, ll, z2 = _planner_states(model, 2, nodes, gpn)
    _, ds2 = s12.estimate_zero2_model_states_mem_needs(total, gpn, nodes, cpu_offload=False)
    assert abs(z2 - ds2) <= 1  # DeepSpeed truncates to int
    _, _, z3 = _planner_states(model, 3, nodes, gpn)
    _, ds3, _ = s3.estimate_zero3_model_states_mem_needs(
        total, ll, gpn, nodes, cpu_offload=False, cpu_offload_params=False
    )
    assert abs(z3 - ds3) <= 1


def test_all_cold_printouts_agree():
    """The `_all_cold` functions print per-GPU GiB to two decimals; the planner's number,
    rounded the same way, is in their no-offload row."""
    s12, s3 = _ds()
    total, ll, z2 = _planner_states("llama3_70b", 2, 4, 8)
    _, _, z3 = _planner_states("llama3_70b", 3, 4, 8)
    for fn, args, ours in (
        (s12.estimate_zero2_model_states_mem_needs_all_cold, (total, 8, 4), z2),
        (s3.estimate_zero3_model_states_mem_needs_all_cold, (total, ll, 8, 4), z3),
    ):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            fn(*args)
        rows = [r for r in buf.getvalue().splitlines() if "offload_optimizer=none" in r]
        gpu_gib = [float(re.findall(r"\|\s*([\d.]+)GB\s*\|", r)[0]) for r in rows]
        assert f"{ours / 2**30:.2f}" in [f"{g:.2f}" for g in gpu_gib]


def test_plan_command_matches_deepspeed_at_tp1_pp1():
    """A whole `mbr plan` run, pinned to TP=PP=1 ZeRO-2 on the DeepSpeed engine: the chosen
    layout's weights + grads + optimizer bytes equal DeepSpeed's estimate."""
    from megatron_bridge.commands.plan import plan

    s12, _ = _ds()
    _, _, doc = plan(
        [
            "model=llama3_8b",
            "cluster=dgx_h100",
            "cluster.nodes=4",
            "train.engine=deepspeed",
            "zero.stage=2",
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.cp=1",
            "train.seq_length=2048",
            "train.global_batch_size=256",
            "train.recompute=selective",
        ]
    )
    st = doc["choice"]["memory"]["stages"][0]
    _, ds2 = s12.estimate_zero2_model_states_mem_needs(8_030_261_248, 8, 4, cpu_offload=False)
    assert abs(st["weights"] + st["grads"] + st["optimizer"] - ds2) <= 1
    assert doc["choice"]["layout"]["dp"] == 32


# -- the medium-scale rule of thumb ----------------------------------------------------------
def test_twenty_billion_fp32_fills_a_40gb_node():
    """params = node bytes / (4 weight-sized tensors × precision): 8×40 GB / (4·4 B) = 20B.
    The planner's fp32 states are exactly those four tensors (weights, grads, Adam m, v)."""
    assert sum(M.STATE_BYTES[("megatron", "fp32")]) == 4 * 4
    st = M.model_states(20e9 / 8, 0, engine="megatron", precision="fp32", zero=0, dp_shard=1, edp_shard=1)
    assert st.total == 40e9  # per GPU at tp=8: one A100-40GB, i.e. the whole node for 20B parameters
    # bf16 mixed precision also keeps 16 bytes per parameter (bf16 weights + grads, fp32 main
    # params + m + v), so 20B is the node's ceiling for model states with either precision;
    # the rule of thumb's upper end (40B) assumes bf16 Adam states, which neither engine keeps.
    assert sum(M.STATE_BYTES[("megatron", "bf16")]) == 16
    # "large DP size with model sharding allows us to train larger models": ZeRO-1 over 4
    # nodes (dp=4 at tp=8) leaves 4 + 12/4 = 7 bytes per parameter.
    st4 = M.model_states(20e9 / 8, 0, engine="megatron", precision="bf16", zero=1, dp_shard=4, edp_shard=4)
    assert st4.total == 20e9 / 8 * 7
