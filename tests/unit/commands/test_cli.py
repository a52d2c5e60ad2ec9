"""`mbr check` as a user runs it: exit codes, messages, no tracebacks, config printing."""

import json
import subprocess
import sys

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose, list_group, list_recipes, parse_args


def mbr(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_check_prints_rank_map_and_exits_0():
    r = mbr("check", "recipe=tiny_llama", "parallel.tp=2", "parallel.pp=2")
    assert r.returncode == 0, r.stderr
    assert "layout OK: tp2·pp2" in r.stdout and "node 0:" in r.stdout
    assert "tp=0-1 pp=0,2" in r.stdout  # rank 0's TP group and PP group


@pytest.mark.parametrize(
    "args,needle",
    [
        (["recipe=tiny_llama", "parallel.tp=3"], "[heads-tp]"),
        (["recipe=tiny_llama", "parallel.tpp=2"], "Key 'tpp' not in 'ParallelConfig'"),
        (["recipe=tiny_llama", "parallel.tp=two"], "could not be converted to Integer"),
        (["recipe=nope"], "unknown recipe 'nope'"),
        (["model=llama9"], "Could not find 'model/llama9'"),
        (["recipe=tiny_llama", "zero.stage=2"], "[zero-pp]"),
        (["model.hf_path=/nonexistent/dir"], "no config.json there"),
        (["stray"], "unexpected argument 'stray'"),
    ],
)
def test_user_errors_exit_2_without_traceback(args, needle):
    r = mbr("check", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ")


def test_unknown_command():
    r = mbr("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_debug_shows_traceback(monkeypatch):
    r = mbr("check", "recipe=tiny_llama", "parallel.tp=3", "debug=true")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_cfg_job_prints_resolved_config():
    r = mbr("check", "recipe=tiny_llama", "parallel.tp=1", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    assert "parallel:\n  tp: 1\n  pp: 2" in r.stdout
    assert "gpus_per_node: 4" in r.stdout  # the env interpolation is resolved


def test_every_shipped_recipe_validates(tmp_path):
    """Every recipe passes `mbr check` as shipped, except that a LoRA recipe needs the base model
    it adapts, a DPO recipe its reference's weights (the initial policy's), a distillation recipe
    its teacher and a VLM recipe the model it runs (model.hf_path): without one it is refused by
    exactly that rule, with one it passes."""
    from megatron_bridge.runtime.tiny import make_tiny

    for name in list_recipes():
        r = mbr("check", f"recipe={name}")
        if name.startswith("dpo_"):
            assert r.returncode == 2 and "[dpo-reference]" in r.stderr and "breaks 1 rule" in r.stderr, (name, r.stderr)
            r = mbr("check", f"recipe={name}", f"train.init_from={tmp_path}")
        if name.startswith("distill_"):
            assert r.returncode == 2 and "[distill-teacher]" in r.stderr and "breaks 1 rule" in r.stderr, (
                name,
                r.stderr,
            )
            teacher = make_tiny("llama", tmp_path / "teacher", vocab_size=512, num_hidden_layers=6)
            r = mbr("check", f"recipe={name}", f"objective.teacher={teacher}")
        if name.startswith("lora_"):
            assert r.returncode == 2 and "[lora-base]" in r.stderr and "breaks 1 rule" in r.stderr, (name, r.stderr)
            r = mbr("check", f"recipe={name}", f"train.init_from={tmp_path}")
        if name.endswith("_vlm"):
            from tests.vlm_processor import make_vlm

            assert r.returncode == 2 and "[model-backend]" in r.stderr and "breaks 1 rule" in r.stderr, (name, r.stderr)
            r = mbr("check", f"recipe={name}", f"model.hf_path={make_vlm(tmp_path / 'vlm')}")
        assert r.returncode == 0, (name, r.stderr)


def test_groups_shipped():
    assert {
        "tiny_llama",
        "tiny_mixtral",
        "llama3_8b",
        "llama3_70b",
        "llama3_405b",
        "mixtral_8x7b",
        "gpt3_175b",
        "gpt_1t",
    } <= set(list_group("model"))
    assert {"cpu_local", "dgx_a100_40g", "dgx_a100_80g", "dgx_h100"} <= set(list_group("cluster"))
    cfg, _ = compose(["model=gpt_1t"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_attention_heads) == (25600, 128, 160)


def test_model_from_hf_path(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.Qwen2Config(
        hidden_size=96,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=1000,
        rope_theta=12345.0,
    )
    hf.save_pretrained(tmp_path)
    cfg, _ = compose([f"model.hf_path={tmp_path}"])
    m = describe(cfg.model)
    assert (m.family, m.num_layers, m.hidden_size, m.ffn_hidden_size) == ("qwen2", 6, 96, 192)
    assert (m.num_attention_heads, m.num_query_groups, m.vocab_size, m.rotary_base) == (6, 2, 1000, 12345.0)
    assert m.add_qkv_bias  # implicit in Qwen2, not written to config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = mbr("check", f"model.hf_path={tmp_path}")
    assert r.returncode == 2 and "(model_type 'bert') has no native family" in r.stderr
    assert "no base_model_tp_plan" in r.stderr  # and what the transformers backend lacks to run it


def test_deepspeed_local_rank_argument_dropped():
    args = parse_args(["--local_rank=3", "recipe=tiny_llama", "parallel.tp=2", "--local_rank", "1"])
    assert args.recipe == "tiny_llama" and args.overrides == ["parallel.tp=2"] and args.flags == []
