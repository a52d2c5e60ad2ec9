"""One model description, derived once: `backends.describe(cfg.model)` is the only reader of
the recipe's model group, `bridge.hf_config.read_hf_config` the only parser of config.json,
and shared code reaches the model through the backend seam."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import megatron_bridge
from megatron_bridge.backends.describe import describe, describe_hf
from megatron_bridge.backends.registry import BACKENDS, backend_of
from megatron_bridge.config.compose import compose
from megatron_bridge.errors import LayoutError

ROOT = Path(megatron_bridge.__file__).parent
CONFIG_NAMES = {"cfg", "config", "vcfg", "proxy", "run"}  # how the code names a composed Config


def _sources():
    for p in sorted(ROOT.rglob("*.py")):
        yield p.relative_to(ROOT).as_posix(), ast.parse(p.read_text())


def test_only_describe_reads_the_model_group():
    """`<config>.model` appears only as the argument of a `describe(...)` call (or of
    `chosen_backend(...)`, the backend it names, or `frozen_parts(...)`, what training freezes),
    outside backends/describe.py (which reads its fields) — or is handed on whole, unread, as the
    `model=` of a stand-in config the rules read (`SimpleNamespace(..., model=cfg.model)`: the
    planner's per-layout proxy of the recipe)."""
    bad = []
    for rel, tree in _sources():
        if rel == "backends/describe.py":
            continue
        allowed: set[int] = set()
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", "")) in (
                "describe",
                "describe_model",
                "chosen_backend",
                "frozen_parts",
            ):
                allowed |= {id(a) for a in call.args}
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "SimpleNamespace":
                allowed |= {id(k.value) for k in call.keywords if k.arg == "model"}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "model"
                and isinstance(node.value, ast.Name)
                and node.value.id in CONFIG_NAMES
                and id(node) not in allowed
            ):
                bad.append(f"{rel}:{node.lineno}")
    assert not bad, bad


def test_config_json_is_parsed_in_one_function():
    """Every `json.load(s)` whose source line names config.json is in read_hf_config."""
    found = []
    for rel, tree in _sources():
        lines = (ROOT / rel).read_text().splitlines()
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for call in ast.walk(fn):
                if (
                    isinstance(call, ast.Call)
                    and getattr(call.func, "attr", "") in ("load", "loads")
                    and getattr(call.func.value, "id", "") == "json"
                ):
                    text = "\n".join(lines[fn.lineno - 1 : fn.end_lineno])
                    if "config.json" in text:
                        found.append(f"{rel}:{fn.name}")
    assert sorted(set(found)) == ["bridge/hf_config.py:read_hf_config"]


def test_a_recipe_model_and_its_config_json_describe_the_same_model(tmp_path):
    from megatron_bridge.bridge.hf_config import spec_to_hf_config

    cfg, _ = compose(["recipe=tiny_llama"])
    fields = describe(cfg.model)
    assert fields.described_from == "model fields" and fields.source is None and fields.backend == "native"
    (tmp_path / "config.json").write_text(__import__("json").dumps(spec_to_hf_config(fields)))
    cfg.model.hf_path = str(tmp_path)
    cfg.model.num_layers = 99  # with hf_path the group's fields do not apply
    from_json = describe(cfg.model)
    assert from_json == fields and from_json.source == str(tmp_path) and from_json.described_from == "config.json"
    assert backend_of(from_json) is BACKENDS["native"]
    assert backend_of(from_json).count(from_json) == backend_of(fields).count(fields)


@pytest.mark.parametrize(
    "overrides,rule",
    [(["model.family=gpt2"], "model-family"), (["model.hidden_size=66"], "hidden-heads")],
)
def test_a_model_that_cannot_be_described_is_refused_by_a_named_rule(overrides, rule):
    cfg, _ = compose(["recipe=tiny_llama", *overrides])
    with pytest.raises(LayoutError) as e:
        describe(cfg.model)
    assert [v.rule for v in e.value.violations] == [rule]


def test_describe_hf_goes_through_the_backend_that_handles_the_config():
    hf = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "vocab_size": 100,
    }
    spec = describe_hf(hf)
    assert spec.family == "qwen2" and spec.add_qkv_bias and spec.backend == "native"
    assert backend_of(spec).table(spec)  # the rows that name and shard its tensors
