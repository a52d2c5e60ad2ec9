"""Layouts `mbr check` accepts build and train under torchrun, with the parameters per
pipeline rank that `mbr plan` counts (the sampled part of tests/unit/commands/test_check_train_agree.py).

One launch of 2 processes runs every job: issue 13's uneven first stage (5 layers on pp2,
1 + 4), an MoE model with TP and sequence parallelism turned on automatically, a GPT-style
model (LayerNorm, GELU, biases, learned positions) on pp2·vpp2 with full recompute, and an
uneven last stage with selective recompute; and a transformers-backend MoE model on pp2.
"""

import pytest

from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/agree.py"
COMMON = [
    "train.steps=1",
    "optimizer.warmup_steps=0",
    "train.seq_length=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "cluster.gpus_per_node=2",
    "data=synthetic",
]
GPT = [
    "model.family=gpt",
    "model.normalization=LayerNorm",
    "model.gated_linear_unit=false",
    "model.add_bias_linear=true",
    "model.position_embedding_type=learned_absolute",
]
JOBS = {
    "issue13_first1": [
        "recipe=tiny_llama",
        "parallel.tp=1",
        "parallel.pp=2",
        "model.num_layers=5",
        "parallel.layers_first_stage=1",
    ],
    "moe_tp2_auto_sp": ["recipe=tiny_mixtral", "parallel.tp=2", "parallel.ep=1"],
    "gpt_pp2vpp2_full": [
        "recipe=tiny_llama",
        "parallel.tp=1",
        "parallel.pp=2",
        "parallel.vpp=2",
        *GPT,
        "train.recompute=full",
    ],
    "last1_selective": [
        "recipe=tiny_llama",
        "parallel.tp=1",
        "parallel.pp=2",
        "model.num_layers=3",
        "parallel.layers_last_stage=1",
        "train.recompute=selective",
    ],
}


def test_accepted_layouts_build_the_planned_parameters_and_train(tmp_path):
    from megatron_bridge.runtime.hf_tiny import make_tiny

    # a transformers-backend MoE model (its first layer dense) split over two stages
    moe = make_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    todo = {
        **JOBS,
        "hf_moe_pp2": ["recipe=tiny_llama", f"model.hf_path={moe}", "model.backend=transformers", "parallel.tp=1", "parallel.pp=2"],
    }
    jobs = [f"{name}:" + ",".join([*o, *COMMON]) for name, o in todo.items()]
    res = run_torchrun([SCRIPT, str(tmp_path), *jobs], nproc=2, timeout=600)
    for rank, r in enumerate(res):
        for name in todo:
            got = r["jobs"][name]
            assert got["trained"] == 0, (rank, name)
            assert got["built"] == got["planned"], (rank, name, got)
    assert {r["jobs"]["issue13_first1"]["pp_rank"] for r in res} == {0, 1}
    assert (tmp_path / "issue13_first1" / "metrics.jsonl").is_file()
