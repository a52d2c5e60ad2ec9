"""One test per layout rule: the CLI override that breaks it is refused, naming the rule.

Cases go through `compose` with the documented CLI names, so they also prove every name
is overridable. Each case also asserts that the *valid* neighbour passes (a rule that
refuses everything would otherwise look correct).
"""

import dataclasses

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError
from megatron_bridge.parallel.dims import ParallelDims, padded_vocab_size
from megatron_bridge.parallel.rules.registry import validate


def violations(*overrides, recipe="tiny_llama"):
    cfg, _ = compose([f"recipe={recipe}", *overrides])
    try:
        validate(cfg, describe(cfg.model))
    except LayoutError as e:
        return {v.rule for v in e.violations}, str(e)
    return set(), ""


CASES = [  # (rule, breaking overrides, passing overrides, recipe)
    ("world-size", ["parallel.dp=2"], ["parallel.dp=1"], "tiny_llama"),
    ("world-size", ["cluster.gpus_per_node=6"], ["cluster.gpus_per_node=8"], "tiny_llama"),
    (
        "heads-tp",
        [
            "model.num_attention_heads=6",
            "model.hidden_size=96",
            "parallel.tp=4",
            "parallel.pp=1",
            "model.num_query_groups=4",
        ],
        [
            "model.num_attention_heads=8",
            "model.hidden_size=96",
            "parallel.tp=4",
            "parallel.pp=1",
            "model.num_query_groups=4",
        ],
        "tiny_llama",
    ),
    (
        "kv-heads-tp",
        [
            "parallel.tp=4",
            "parallel.pp=1",
            "model.num_query_groups=6",
            "model.num_attention_heads=12",
            "model.hidden_size=96",
        ],
        ["parallel.tp=4", "parallel.pp=1", "model.num_query_groups=2"],
        "tiny_llama",
    ),  # kv < tp, tp % kv == 0: fine
    (
        "moe-tp-sp",
        ["parallel.tp=2", "parallel.sequence_parallel=false"],
        ["parallel.tp=2", "parallel.sequence_parallel=true"],
        "tiny_mixtral",
    ),
    (
        "layers-uneven",
        ["parallel.pp=2", "model.num_layers=5", "parallel.layers_first_stage=0"],
        ["parallel.pp=2", "model.num_layers=5", "parallel.layers_first_stage=1"],
        "tiny_llama",
    ),
    (
        "model-architecture",
        ["model.normalization=LayerNorm"],
        ["model.family=gpt", "model.normalization=LayerNorm"],
        "tiny_llama",
    ),
    ("model-architecture", ["model.add_bias_linear=true"], [], "tiny_llama"),
    ("choice", ["model.family=gpt", "model.normalization=ScaleNorm"], ["model.family=gpt"], "tiny_llama"),
    ("model-family", ["model.family=gpt2"], ["model.family=gpt"], "tiny_llama"),
    ("hf-weights", ["model.family=gpt", "train.init_from=/tmp"], ["train.init_from=/tmp"], "tiny_llama"),
    ("hidden-heads", ["model.hidden_size=66"], ["model.hidden_size=68"], "tiny_llama"),
    ("layers-pp", ["model.num_layers=5"], ["model.num_layers=6"], "tiny_llama"),
    ("layers-pp", ["parallel.vpp=2", "model.num_layers=6"], ["parallel.vpp=2", "model.num_layers=8"], "tiny_llama"),
    (
        "layers-uneven",
        ["model.num_layers=5", "parallel.layers_first_stage=1", "parallel.layers_last_stage=1"],
        ["model.num_layers=5", "parallel.layers_first_stage=2"],
        "tiny_llama",
    ),
    (
        "seq-cp",
        ["parallel.pp=1", "parallel.cp=2", "train.seq_length=66"],
        ["parallel.pp=1", "parallel.cp=2", "train.seq_length=68"],
        "tiny_llama",
    ),
    (
        "seq-sp",
        ["parallel.sequence_parallel=true", "train.seq_length=63"],
        ["parallel.sequence_parallel=true", "train.seq_length=62"],
        "tiny_llama",
    ),
    (
        "experts-ep",
        ["parallel.ep=4", "model.num_moe_experts=6"],
        ["parallel.ep=2", "model.num_moe_experts=6"],
        "tiny_mixtral",
    ),
    ("ep-dense", ["parallel.ep=2", "parallel.tp=1", "parallel.pp=1"], ["parallel.tp=1", "parallel.pp=1"], "tiny_llama"),
    (
        "expert-grid",
        ["parallel.ep=4", "parallel.tp=2", "parallel.etp=2", "cluster.gpus_per_node=4"],
        ["parallel.ep=2", "parallel.tp=2", "parallel.etp=2", "cluster.gpus_per_node=4"],
        "tiny_mixtral",
    ),
    ("global-batch", ["train.global_batch_size=7"], ["train.global_batch_size=12"], "default"),
    ("global-batch", ["train.grad_accum=3"], ["train.grad_accum=4"], "tiny_llama"),
    ("microbatches-pp", ["train.global_batch_size=2"], ["train.global_batch_size=4"], "tiny_llama"),
    ("vpp-pp", ["parallel.vpp=2", "parallel.pp=1", "parallel.tp=1"], ["parallel.tp=1"], "tiny_llama"),
    (
        "vpp-microbatches",
        ["parallel.vpp=2", "train.global_batch_size=6"],
        ["parallel.vpp=2", "train.global_batch_size=8"],
        "tiny_llama",
    ),
    ("zero-pp", ["zero.stage=2", "train.engine=deepspeed"], ["zero.stage=1", "train.engine=deepspeed"], "tiny_llama"),
    ("zero-engine", ["zero.stage=3"], ["zero.stage=3", "train.engine=deepspeed"], "default"),
    ("zero-stage", ["zero.stage=4"], ["zero.stage=1"], "default"),
    (
        "zero-offload",
        ["zero.offload_param=cpu", "zero.stage=2", "train.engine=deepspeed"],
        ["zero.offload_param=cpu", "zero.stage=3", "train.engine=deepspeed"],
        "default",
    ),
    (
        "tp-in-node",
        ["parallel.tp=4", "parallel.pp=1", "cluster.nodes=2", "cluster.gpus_per_node=2", "model.num_query_groups=4"],
        ["parallel.tp=2", "parallel.pp=2", "cluster.nodes=2", "cluster.gpus_per_node=2"],
        "tiny_llama",
    ),
    (
        "cp-in-node",
        ["parallel.pp=1", "parallel.cp=2", "cluster.nodes=2", "cluster.gpus_per_node=2"],
        ["parallel.pp=2", "parallel.cp=1", "cluster.nodes=2", "cluster.gpus_per_node=2"],
        "tiny_llama",
    ),
    ("deepspeed-engine", ["train.engine=deepspeed"], ["train.engine=deepspeed", "parallel.pp=1"], "tiny_llama"),
    (
        "deepspeed-engine",
        ["train.engine=deepspeed", "parallel.cp=2", "parallel.tp=1", "parallel.pp=1"],
        ["train.engine=deepspeed", "parallel.tp=2", "parallel.pp=1"],
        "tiny_llama",
    ),
    ("positive-degree", ["parallel.tp=-2"], ["parallel.tp=1", "parallel.pp=1"], "tiny_llama"),
    ("positive-degree", ["train.micro_batch_size=0"], ["train.micro_batch_size=1"], "tiny_llama"),
    ("choice", ["train.engine=jax"], ["train.engine=deepspeed"], "default"),
    ("choice", ["train.recompute=some"], ["train.recompute=selective"], "default"),
    (
        "eval-split",
        ["data.kind=indexed", "data.split=100/0/0", "train.eval_iters=2"],
        ["data.kind=indexed", "data.split=98/2/0", "train.eval_iters=2"],
        "default",
    ),
    ("eval-iters", ["train.eval_interval=5"], ["train.eval_interval=5", "train.eval_iters=2"], "default"),
    ("eval-iters", ["train.eval_iters=-1"], ["train.eval_iters=0"], "default"),
    (
        "sft-packing-cp",
        ["data=sft", "parallel.cp=2", "parallel.pp=1"],
        ["data=sft", "data.packing=false", "parallel.cp=2", "parallel.pp=1"],
        "tiny_llama",
    ),
    ("choice", ["data.kind=chat"], ["data.kind=sft"], "default"),
]


@pytest.mark.parametrize("rule,bad,good,recipe", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule(rule, bad, good, recipe):
    got, msg = violations(*bad, recipe=recipe)
    assert rule in got, (got, msg)
    assert f"[{rule}]" in msg and "Fix:" in msg
    got_good, msg_good = violations(*good, recipe=recipe)
    assert rule not in got_good, msg_good


def test_all_violations_reported_at_once():
    got, msg = violations(
        "parallel.tp=3", "zero.stage=2", "train.seq_length=63", "parallel.cp=2", "parallel.sequence_parallel=true"
    )
    assert {
        "world-size",
        "heads-tp",
        "kv-heads-tp",
        "seq-cp",
        "seq-sp",
        "zero-pp",
        "zero-engine",
        "tp-in-node",
    } <= got  # kv=2, tp=3: neither divides
    assert msg.count("Fix:") == len(got) >= 8


def test_cross_node_tp_override_turns_error_into_warning():
    ov = ["parallel.tp=4", "parallel.pp=1", "cluster.nodes=2", "cluster.gpus_per_node=2", "model.num_query_groups=4"]
    cfg, _ = compose(["recipe=tiny_llama", *ov, "parallel.allow_cross_node_tp=true"])
    dims, notes = validate(cfg, describe(cfg.model))
    assert dims.tp == 4 and any("cross node" in n for n in notes)


def test_inference_of_dp_and_grad_accum():
    cfg, _ = compose(["recipe=gpt_1t"])
    dims, _ = validate(cfg, describe(cfg.model))
    assert (dims.tp, dims.pp, dims.dp, dims.world_size) == (8, 64, 8, 4096)
    assert dims.grad_accum == 3072 // 8 and dims.dp_inferred
    cfg, _ = compose(["recipe=tiny_llama", "parallel.pp=1", "parallel.tp=1"])
    dims, _ = validate(cfg, describe(cfg.model), world_size=2)  # a launcher's WORLD_SIZE wins over the cluster
    assert (dims.dp, dims.grad_accum) == (2, 2)


def test_vocab_padding_reported():
    assert padded_vocab_size(50257, 128, 8) == 51200
    cfg, _ = compose(["recipe=tiny_llama", "model.vocab_size=500"])
    _, notes = validate(cfg, describe(cfg.model))
    assert any("vocab 500 padded to 512" in n for n in notes)


def test_dims_frozen():
    d = ParallelDims(world_size=4, gpus_per_node=4, tp=2, dp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.tp = 4  # type: ignore[misc]


def test_moe_with_tp_turns_sequence_parallel_on_with_a_note():
    """parallel.sequence_parallel unset (auto): on for MoE with tp > 1, said as a note; off
    for dense models; a pinned false stays an error naming the pin."""
    cfg, _ = compose(["recipe=tiny_mixtral", "parallel.tp=2"])
    dims, notes = validate(cfg, describe(cfg.model))
    assert dims.sequence_parallel and any("turned on automatically" in n for n in notes)
    cfg, _ = compose(["recipe=tiny_llama", "parallel.tp=2"])
    dims, notes = validate(cfg, describe(cfg.model))
    assert not dims.sequence_parallel and not any("automatically" in n for n in notes)
    got, msg = violations("parallel.tp=2", "parallel.sequence_parallel=false", recipe="tiny_mixtral")
    assert got == {"moe-tp-sp"} and "pinned" in msg


def test_hf_model_the_builder_refuses_is_refused_by_check(tmp_path):
    """Training builds from the HF config through the bridge; what the bridge refuses there,
    `mbr check` refuses too (rule hf-model), instead of passing a layout that cannot train."""
    import json

    from megatron_bridge.runtime.tiny import make_tiny

    good = make_tiny("llama", tmp_path / "llama")
    cfg = json.loads((good / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    assert violations(f"model.hf_path={good}", "parallel.tp=1", "parallel.pp=1", recipe="default")[0] == set()
    got, msg = violations(f"model.hf_path={bad}", "parallel.tp=1", "parallel.pp=1", recipe="default")
    assert got == {"hf-model"} and "o_proj bias" in msg
