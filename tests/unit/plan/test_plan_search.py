"""`mbr plan`'s search and command: the worked examples of docs/plan.md, pins, spans, errors, speed."""

import json
import subprocess
import sys
import time

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.commands.plan import plan
from megatron_bridge.config.compose import compose
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.topology import Topology
from megatron_bridge.plan import comm as C
from megatron_bridge.plan import memory as M
from megatron_bridge.plan.evaluation import Context
from megatron_bridge.plan.search import pinned_from_overrides, search

GIB = 2**30
ONE_T = [
    "model=gpt_1t",
    "cluster=dgx_a100_40g",
    "cluster.nodes=512",
    "train.seq_length=2048",
    "train.global_batch_size=3072",
]
GPT3 = [
    "model=gpt3_175b",
    "cluster=dgx_a100_80g",
    "cluster.nodes=128",
    "train.seq_length=2048",
    "train.global_batch_size=1536",
]


def mbr(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_1t_on_4096_a100_40gb_is_tp8_pp64_dp8():
    """docs/plan.md's worked example: 1T parameters on 4,096 A100-40GB -> 8-way TP x 64-way PP x 8-way DP."""
    _, _, doc = plan(ONE_T)
    lo, mem = doc["choice"]["layout"], doc["choice"]["memory"]
    assert (lo["tp"], lo["pp"], lo["cp"], lo["dp"]) == (8, 64, 1, 8)
    assert doc["model"]["params_total"] == 1_008_038_758_400
    # "around 16TB for model states alone": 16 bytes per parameter, 2 layers + embedding per
    # GPU of the 512-GPU replica; it fits by itself (without ZeRO) in 40 GiB
    assert mem["fits_without_zero"] and mem["without_zero_bytes"] <= 40 * GIB
    # ZeRO-1 then shards the 12 optimizer bytes over dp=8
    first = mem["stages"][0]
    assert first["optimizer"] == pytest.approx(12 * first["params"] / 8)
    assert lo["recompute"] == "full"  # 128 layers x sbh/t x 34 of selective activations is ~28 GB
    # why not fewer stages: pp=32 only fits if ZeRO shards the states over DP
    pp32 = [a for a in doc["alternatives"] if (a["layout"]["tp"], a["layout"]["pp"], a["layout"]["cp"]) == (8, 32, 1)]
    assert pp32 and not pp32[0]["memory"]["fits_without_zero"] and "ZeRO-1" in pp32[0]["why_lost"]
    assert pp32[0]["memory"]["without_zero_bytes"] > 60 * GIB  # 3.9B params x 16 B


def test_175b_on_1024_a100_is_tp8_pp16_dp8():
    """docs/plan.md's worked example: GPT-3 175B on 1,024 A100 (128 nodes) -> TP 8, PP 16 (6 layers/stage), DP 8."""
    _, _, doc = plan(GPT3)
    ch = doc["choice"]
    lo = ch["layout"]
    assert (lo["tp"], lo["pp"], lo["cp"], lo["dp"]) == (8, 16, 1, 8)
    assert ch["memory"]["stages"][0]["layers"] == 6
    assert lo["recompute"] == "none" and lo["sequence_parallel"]
    assert ch["rank_map"]["tp"] == "intra-node" and ch["rank_map"]["pp"] == "inter-node"
    assert ch["communication"]["tp"]["link"] == "intra-node"
    assert ch["communication"]["tp"]["bandwidth_gbps"] == 300.0
    assert ch["communication"]["dp"]["link"] == "inter-node"
    m, v = lo["grad_accum"], lo["vpp"] or 1
    assert m == 1536 // 8 and ch["pipeline"]["bubble_fraction"] == pytest.approx(15 / (v * m))


def test_narayanan_18b_fits_a_node_as_tp8_dp():
    """docs/plan.md's medium-scale example: a replica that fits in one node trains as DP + TP (pp=1).
    Narayanan et al. 2021, Table 1: 18.4B (h=6144, 40 layers, 48 heads) on 256 A100 -> TP 8."""
    _, _, doc = plan(
        [
            "model=gpt3_175b",
            "model.name=gpt_18b",
            "model.hidden_size=6144",
            "model.ffn_hidden_size=24576",
            "model.num_layers=40",
            "model.num_attention_heads=48",
            "cluster=dgx_a100_80g",
            "cluster.nodes=32",
            "train.seq_length=2048",
            "train.global_batch_size=1024",
        ]
    )
    lo = doc["choice"]["layout"]
    assert (lo["tp"], lo["pp"], lo["dp"]) == (8, 1, 32)
    assert 18e9 < doc["model"]["params_total"] < 19e9


def test_pinned_degrees_are_respected():
    _, _, doc = plan(GPT3 + ["parallel.tp=4", "parallel.pp=32", "train.recompute=selective"])
    lo = doc["choice"]["layout"]
    assert (lo["tp"], lo["pp"], lo["recompute"]) == (4, 32, "selective")
    assert set(doc["pinned"]) == {"tp", "pp", "recompute"}
    assert all(a["layout"]["tp"] == 4 and a["layout"]["pp"] == 32 for a in doc["alternatives"])


def test_recipe_values_are_defaults_not_pins():
    """recipe=gpt_1t sets tp8 pp64 in YAML; only the command line pins."""
    _, args = compose(["recipe=gpt_1t", "parallel.cp=1", "zero=stage1", "train.micro_batch_size=2"])
    assert pinned_from_overrides(args.overrides) == ["cp", "zero", "mbs"]


def test_mixtral_uses_experts_and_reports_active_params():
    _, _, doc = plan(["recipe=mixtral_8x7b"])
    assert doc["model"]["params_active"] == 12_879_925_248 and doc["model"]["moe"]
    lo = doc["choice"]["layout"]
    assert lo["ep"] > 1 and lo["sequence_parallel"]
    assert "ep" in doc["choice"]["communication"]


@pytest.mark.parametrize(
    "tp,cp,dp,pp,ep,etp,gpn",
    [
        (8, 1, 8, 64, 1, 8, 8),
        (2, 2, 4, 2, 1, 2, 8),
        (4, 1, 2, 4, 2, 1, 8),
        (2, 1, 6, 2, 3, 2, 4),
        (1, 3, 4, 2, 1, 1, 6),
        (4, 2, 1, 2, 1, 4, 8),
        (2, 2, 3, 2, 3, 2, 12),
        (1, 1, 12, 1, 4, 1, 3),
        (8, 1, 16, 16, 1, 8, 8),
    ],
)
def test_group_spans_equal_topology(tp, cp, dp, pp, ep, etp, gpn):
    world = tp * cp * dp * pp
    dims = ParallelDims(world_size=world, gpus_per_node=gpn, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, dp=dp)
    topo = Topology(dims)
    ours = C.group_spans(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, gpn=gpn)
    for name in ("tp", "cp", "dp", "dp_cp", "pp", "ep", "edp"):
        assert ours[name] == topo.intra_node(name), name


def test_infeasible_memory_names_smallest_cluster_exit_3():
    r = mbr("plan", *ONE_T[:2], "cluster.nodes=16", *ONE_T[3:])
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "does not fit on 16 node(s)" in r.stderr and "cluster.nodes=64" in r.stderr
    assert "Traceback" not in r.stderr


def test_infeasible_batch_names_the_batch_needed():
    r = mbr("plan", "model=gpt_1t", "cluster=dgx_a100_40g", "cluster.nodes=512", "format=json")
    assert r.returncode == 3
    doc = json.loads(r.stdout)
    assert not doc["feasible"] and doc["choice"] is None
    assert doc["infeasible"]["min_global_batch"] == 512  # tp8·pp64·dp8: mbs·dp·pp = 1·8·64


def test_json_and_table_and_bad_format():
    r = mbr("plan", "recipe=tiny_llama", "format=json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "mbr.plan/1" and doc["feasible"]
    assert doc["cluster"]["world_size"] == 4 and doc["train"]["precision"] == "fp32"
    r = mbr("plan", "recipe=tiny_llama")
    assert r.returncode == 0 and "CHOSEN" in r.stdout and "memory per GPU" in r.stdout
    r = mbr("plan", "recipe=tiny_llama", "format=xml")
    assert r.returncode == 2 and "format='xml'" in r.stderr and "Traceback" not in r.stderr


def test_plan_does_not_import_torch():
    code = (
        "import sys; from megatron_bridge.commands.plan import plan; "
        "plan(['recipe=tiny_llama']); print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.stdout.strip() == "False False", r.stderr


def test_405b_on_16384_gpus_under_2s():
    """Full search (every tp/cp/pp/vpp/ep/zero/recompute/micro batch) plus the report for
    Llama 3 405B on 2,048 DGX H100 nodes; compose is timed separately (Hydra, ~0.3 s)."""
    cfg, args = compose(
        [
            "model=llama3_405b",
            "cluster=dgx_h100",
            "cluster.nodes=2048",
            "train.seq_length=8192",
            "train.global_batch_size=2048",
        ]
    )
    from megatron_bridge.plan import report

    # CPU time of this process, not wall time: the suite runs beside multi-process tests
    t0 = time.process_time()
    ctx = Context.from_config(cfg, describe(cfg.model), pinned_from_overrides(args.overrides))
    res = search(ctx)
    doc = report.build(ctx, res)
    elapsed = time.process_time() - t0
    assert elapsed < 2.0, elapsed
    lo = doc["choice"]["layout"]
    assert lo["tp"] == 8 and lo["dp"] * lo["pp"] * lo["cp"] * 8 == 16384
    assert doc["choice"]["memory"]["total_bytes"] <= 80 * GIB
    assert res.candidates > 500


def test_stage_memory_totals_add_up():
    _, _, doc = plan(GPT3)
    for s in doc["choice"]["memory"]["stages"]:
        allocated = s["weights"] + s["grads"] + s["optimizer"] + s["activations"] + s["logits"]
        assert s["fragmentation"] == pytest.approx(M.FRAGMENTATION * allocated)
        assert s["total"] == pytest.approx(allocated + s["fragmentation"])
    assert doc["choice"]["memory"]["total_bytes"] == max(s["total"] for s in doc["choice"]["memory"]["stages"])


def test_model_from_hf_config_json(tmp_path):
    """`model.hf_path=DIR` plans the architecture in DIR/config.json (Qwen2-7B's shape:
    GQA, QKV bias, untied 152k vocabulary -> 7,615,616,512 parameters)."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "hidden_size": 3584,
                "intermediate_size": 18944,
                "num_hidden_layers": 28,
                "num_attention_heads": 28,
                "num_key_value_heads": 4,
                "vocab_size": 152064,
                "max_position_embeddings": 32768,
                "rope_theta": 1e6,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
            }
        )
    )
    _, _, doc = plan(
        [
            f"model.hf_path={tmp_path}",
            "cluster=dgx_h100",
            "cluster.nodes=2",
            "train.seq_length=4096",
            "train.global_batch_size=128",
        ]
    )
    assert doc["model"]["params_total"] == 7_615_616_512
    lo = doc["choice"]["layout"]
    assert lo["tp"] in (1, 2, 4) and lo["tp"] * lo["pp"] * lo["cp"] * lo["dp"] == 16  # tp must divide 4 KV heads


def test_impossible_pin_is_bad_input_with_the_rules_message():
    r = mbr("plan", "recipe=tiny_llama", "parallel.tp=3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "[heads-tp] num_attention_heads=4 is not divisible by tp=3" in r.stderr


def test_divisors_are_fast_and_exact_for_huge_worlds():
    import time

    from megatron_bridge.plan.search import _divisors

    assert _divisors(12) == [1, 2, 3, 4, 6, 12] and _divisors(16) == [1, 2, 4, 8, 16] and _divisors(0) == []
    t = time.process_time()  # CPU time: robust to a busy machine
    assert _divisors(1 << 22) == [1 << i for i in range(23)]
    assert time.process_time() - t < 1.0
