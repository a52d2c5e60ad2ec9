"""Optimizer, schedule and interval values (parallel/rules/values.py): each bad value is refused by
`validate` (what `mbr check` and the trainer run) naming its rule, and its valid neighbour
passes; every shipped recipe passes; `mbr plan` refuses a bad value as bad input (exit 2)."""

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose, list_recipes
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.rules.registry import refuse, validate


def check(*overrides, recipe="default"):
    cfg, _ = compose([f"recipe={recipe}", *overrides])
    try:
        _, notes = validate(cfg, describe(cfg.model))
    except LayoutError as e:
        return {v.rule for v in e.violations}, str(e)
    return set(), "\n".join(notes)


CASES = [  # (rule, breaking overrides, passing overrides)
    ("lr", ["optimizer.lr=0"], ["optimizer.lr=1e-4", "optimizer.min_lr=0"]),
    ("lr", ["optimizer.lr=-1"], ["optimizer.lr=1"]),
    ("min-lr", ["optimizer.min_lr=1e-3"], ["optimizer.min_lr=3e-4"]),  # lr = 3e-4
    ("min-lr", ["optimizer.min_lr=-1e-5"], ["optimizer.min_lr=0"]),
    ("weight-decay", ["optimizer.weight_decay=-0.01"], ["optimizer.weight_decay=0"]),
    ("adam-betas", ["optimizer.adam_beta1=1.0"], ["optimizer.adam_beta1=0"]),
    ("adam-betas", ["optimizer.adam_beta2=-0.1"], ["optimizer.adam_beta2=0.999"]),
    ("adam-eps", ["optimizer.adam_eps=0"], ["optimizer.adam_eps=1e-12"]),
    ("clip-grad", ["optimizer.clip_grad=-1"], ["optimizer.clip_grad=0"]),
    ("warmup-steps", ["optimizer.warmup_steps=11"], ["optimizer.warmup_steps=10"]),  # steps = 10
    ("warmup-steps", ["optimizer.warmup_steps=-1"], ["optimizer.warmup_steps=0"]),
    ("choice", ["optimizer.decay_style=exp"], ["optimizer.decay_style=inverse-square-root"]),
    ("choice", ["optimizer.decay_style=WSD"], ["optimizer.decay_style=constant"]),  # needs wsd steps
    ("train-steps", ["train.steps=0", "optimizer.warmup_steps=0"], ["train.steps=1", "optimizer.warmup_steps=0"]),
    ("interval", ["train.log_interval=0"], ["train.log_interval=5"]),
    ("interval", ["checkpoint.save_interval=-2"], ["checkpoint.save_interval=0"]),
    ("interval", ["checkpoint.lease_stale_s=0"], ["checkpoint.lease_stale_s=5"]),
    ("interval", ["train.export_interval=-1"], ["train.export_interval=0"]),
    ("interval", ["train.export_buffer_bytes=-1"], ["train.export_buffer_bytes=0"]),
    # FP8 GEMMs: refused on GPUs without FP8 tensor cores; Hopper and the CPU (float8 numerics) run them
    ("fp8", ["cluster=dgx_a100_80g", "train.precision=fp8"], ["cluster=dgx_h100", "train.precision=fp8"]),
    ("fp8", ["cluster=dgx_a100_40g", "train.precision=fp8"], ["cluster=cpu_local", "train.precision=fp8"]),
    ("choice", ["train.precision=fp8", "train.fp8_recipe=blockwise"], ["train.fp8_recipe=rowwise"]),
    # selective recompute: modules megatron-core has and the model has
    (
        "recompute-modules",
        ["train.recompute=selective", "train.recompute_modules=[core_attn,mpl]"],
        ["train.recompute=selective", "train.recompute_modules=[core_attn,mlp,layernorm]"],
    ),
    (
        "recompute-modules",
        ["train.recompute=selective", "train.recompute_modules=[moe]"],
        ["train.recompute=full", "train.recompute_modules=[moe]"],
    ),  # only read with selective
    ("recompute-modules", ["train.recompute=selective", "train.recompute_modules=[]"], ["train.recompute=selective"]),
]


@pytest.mark.parametrize("rule,bad,good", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_value_rule(rule, bad, good):
    rules, msg = check(*bad)
    assert rules == {rule}, msg
    assert f"[{rule}]" in msg and "Fix:" in msg
    assert check(*good)[0] == set()


def test_all_bad_values_reported_at_once():
    rules, msg = check("optimizer.lr=-1", "optimizer.adam_eps=0", "train.log_interval=0", "parallel.dp=3")
    assert rules == {"lr", "adam-eps", "interval", "world-size", "global-batch"}, msg


def test_learned_positions_past_the_table_are_an_error():
    rules, msg = check("train.seq_length=4096", recipe="gpt3_175b")
    assert rules == {"seq-positions"}, msg
    assert "learned absolute position embeddings" in msg and "at most 2048" in msg
    assert check("train.seq_length=2048", recipe="gpt3_175b")[0] == set()


def test_rotary_positions_past_the_table_are_a_warning_naming_the_scaling(tmp_path):
    rules, notes = check("train.seq_length=512", recipe="tiny_llama")
    assert rules == set()
    assert "train.seq_length=512 > model.max_position_embeddings=256" in notes
    assert "no rope scaling (rope_type default, rotary_base 10000)" in notes
    from megatron_bridge.runtime.tiny import make_tiny

    hf = make_tiny("llama", tmp_path / "hf")  # llama3 rope scaling, max_position_embeddings 128
    rules, notes = check(f"model.hf_path={hf}", "train.seq_length=256", "parallel.tp=1", "parallel.pp=1")
    assert rules == set()
    assert "rope scaling llama3 (factor 4" in notes and "original_max_position_embeddings 32" in notes
    assert "max_position_embeddings" not in check("train.seq_length=128", recipe="tiny_llama")[1]


@pytest.mark.parametrize("name", list_recipes())
def test_no_shipped_recipe_is_rejected(name):
    # a LoRA recipe names no base model, a DPO recipe no reference weights, a distillation recipe
    # no teacher, a VLM recipe no model (the user gives them); each is refused for that alone (test_cli)
    needs = {"lora_": "lora-base", "dpo_": "dpo-reference", "distill_": "distill-teacher"}
    given = {rule for prefix, rule in needs.items() if name.startswith(prefix)}
    given |= {"model-backend"} if name.endswith("_vlm") else set()
    assert check(recipe=name)[0] - given == set()


def test_refuse_runs_the_value_rules_once():
    cfg, _ = compose(["recipe=default", "optimizer.lr=-1", "optimizer.decay_style=x"])
    with pytest.raises(UserError) as e:
        refuse(describe(cfg.model), cfg)
    assert "[lr]" in str(e.value) and "[choice]" in str(e.value)
    cfg, _ = compose(["recipe=default"])
    refuse(describe(cfg.model), cfg)


def test_plan_refuses_a_bad_value_as_bad_input(capsys):
    from megatron_bridge.cli import main

    assert main(["plan", "recipe=default", "optimizer.lr=0"]) == 2
    assert "[lr] optimizer.lr=0 must be > 0" in capsys.readouterr().err
