"""The objective rules (parallel/rules/objective.py) through `validate`, what `mbr check` and
the trainer run: each violation fires on its breaking overrides and not on its neighbour,
and the frozen second model (teacher, reference) is read from an HF directory or an
`mbr convert` output like the student's description."""

import json

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.bridge.hf_config import spec_to_hf_config
from megatron_bridge.config.compose import compose
from megatron_bridge.convert.formats.manifest import Manifest
from megatron_bridge.errors import LayoutError
from megatron_bridge.parallel.rules.registry import validate

PAIRS = ["objective=dpo", "data.kind=preference", "data.packing=false"]


def check(*overrides, recipe="default"):
    cfg, _ = compose([f"recipe={recipe}", *overrides])
    try:
        validate(cfg, describe(cfg.model))
    except LayoutError as e:
        return {v.rule for v in e.violations}, str(e)
    return set(), ""


def _student_config(**changes) -> dict:
    cfg, _ = compose(["recipe=default"])
    return {**spec_to_hf_config(describe(cfg.model)), **changes}


def _hf_dir(path, **changes):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_student_config(**changes)))
    return path


@pytest.fixture
def student(tmp_path):
    return _hf_dir(tmp_path / "student")


CASES = [  # (rule, breaking overrides, passing overrides)
    ("choice", ["objective.kind=ppo"], ["objective.kind=lm"]),
    (
        "choice",
        [*PAIRS, "model.hf_path={student}", "objective.loss=kto"],
        [*PAIRS, "model.hf_path={student}", "objective.loss=hinge"],
    ),
    (
        "choice",
        ["objective=distill", "objective.teacher={student}", "objective.divergence=kl"],
        ["objective=distill", "objective.teacher={student}", "objective.divergence=jsd"],
    ),
    ("dpo-data", ["objective=dpo", "objective.loss=simpo"], [*PAIRS, "objective.loss=simpo"]),
    ("preference-objective", ["data.kind=preference", "data.packing=false"], [*PAIRS, "objective.loss=simpo"]),
    ("dpo-cp", [*PAIRS, "objective.loss=simpo", "parallel.cp=2"], [*PAIRS, "objective.loss=simpo", "parallel.cp=1"]),
    ("dpo-reference", PAIRS, [*PAIRS, "model.hf_path={student}"]),
    ("dpo-reference", PAIRS, [*PAIRS, "train.init_from={student}"]),
    ("dpo-reference", PAIRS, [*PAIRS, "objective.reference={student}"]),
    ("dpo-reference", PAIRS, [*PAIRS, "objective.loss=simpo"]),
    ("dpo-reference", PAIRS, [*PAIRS, "model.hf_path={student}", "peft=lora"]),
    (
        "dpo-beta",
        [*PAIRS, "objective.loss=simpo", "objective.beta=0"],
        [*PAIRS, "objective.loss=simpo", "objective.beta=0.5"],
    ),
    (
        "dpo-label-smoothing",
        [*PAIRS, "model.hf_path={student}", "objective.label_smoothing=0.5"],
        [*PAIRS, "model.hf_path={student}", "objective.label_smoothing=0.49"],
    ),
    (
        "dpo-label-smoothing",
        [*PAIRS, "model.hf_path={student}", "objective.label_smoothing=-0.1"],
        [*PAIRS, "model.hf_path={student}", "objective.label_smoothing=0"],
    ),
    (
        "dpo-label-smoothing",
        [*PAIRS, "model.hf_path={student}", "objective.loss=ipo", "objective.label_smoothing=0.1"],
        [*PAIRS, "model.hf_path={student}", "objective.loss=ipo", "objective.label_smoothing=0"],
    ),
    (
        "finite-value",
        [*PAIRS, "objective.loss=simpo", "objective.simpo_gamma=inf"],
        [*PAIRS, "objective.loss=simpo", "objective.simpo_gamma=-1"],
    ),
    (
        "distill-temperature",
        ["objective=distill", "objective.teacher={student}", "objective.temperature=0"],
        ["objective=distill", "objective.teacher={student}", "objective.temperature=0.5"],
    ),
    (
        "distill-alpha",
        ["objective=distill", "objective.teacher={student}", "objective.alpha=1.5"],
        ["objective=distill", "objective.teacher={student}", "objective.alpha=1"],
    ),
    (
        "distill-alpha",
        ["objective=distill", "objective.teacher={student}", "objective.alpha=-0.1"],
        ["objective=distill", "objective.teacher={student}", "objective.alpha=0"],
    ),
    ("distill-teacher", ["objective=distill"], ["objective=distill", "objective.teacher={student}"]),
]


@pytest.mark.parametrize("rule,bad,good", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_objective_rule(rule, bad, good, student):
    rules, msg = check(*(o.format(student=student) for o in bad))
    assert rules == {rule}, msg
    assert f"[{rule}]" in msg and "Fix:" in msg
    assert check(*(o.format(student=student) for o in good)) == (set(), "")


def test_objective_values_of_another_kind_are_not_read():
    assert check("objective.beta=0", "objective.alpha=2", "objective.temperature=0")[0] == set()


@pytest.mark.parametrize("key", ["teacher", "reference"])
def test_the_second_model_must_be_a_model_directory(key, tmp_path):
    kind = ["objective=distill"] if key == "teacher" else PAIRS
    (tmp_path / "empty").mkdir()
    rules, msg = check(*kind, f"objective.{key}={tmp_path / 'empty'}")
    assert rules == {"frozen-model"}, msg
    assert f"objective.{key}={tmp_path / 'empty'} is neither a Hugging Face model directory" in msg


def test_a_converted_checkpoint_is_a_teacher(tmp_path):
    out = tmp_path / "converted"
    out.mkdir()
    man = Manifest(
        format="torch",
        hf_config=_student_config(vocab_size=1000),
        layout={"tp": 1, "pp": 1},
        dtype="float32",
        make_vocab_size_divisible_by=1,
        tensors={},
    )
    man.write(out)
    rules, msg = check("objective=distill", f"objective.teacher={out}")
    assert rules == {"frozen-vocab"}, msg  # its manifest's config.json is what was read
    assert "vocab_size=1000, the student 512" in msg
    man.hf_config = _student_config()
    man.write(out)
    from megatron_bridge.backends.frozen_model import describe_frozen

    describe_frozen.cache_clear()
    assert check("objective=distill", f"objective.teacher={out}") == (set(), "")


def test_teacher_vocabulary_must_be_the_students(tmp_path):
    teacher = _hf_dir(tmp_path / "teacher", vocab_size=520)  # pads to the student's 576 (×64), still refused
    rules, msg = check("objective=distill", f"objective.teacher={teacher}")
    assert rules == {"frozen-vocab"}, msg
    assert f"objective.teacher={teacher} has vocab_size=520, the student 512" in msg


def test_teacher_must_split_under_the_students_layout(tmp_path):
    teacher = _hf_dir(tmp_path / "teacher", num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3)
    rules, msg = check("objective=distill", f"objective.teacher={teacher}", "parallel.tp=4", "parallel.dp=1")
    assert rules == {"frozen-layout"}, msg
    assert "num_attention_heads=2 is not divisible by tp=4 (shape rule heads-tp)" in msg
    rules, msg = check("objective=distill", f"objective.teacher={teacher}", "parallel.pp=2", "parallel.dp=2")
    assert rules == {"frozen-layout"} and "num_layers=3 is not divisible by pp·vpp" in msg, msg
    assert check("objective=distill", f"objective.teacher={teacher}", "parallel.tp=2", "parallel.dp=2") == (set(), "")


def test_a_teacher_its_backend_cannot_build_names_the_key(tmp_path):
    teacher = _hf_dir(tmp_path / "teacher", architectures=["NoSuchForCausalLM"], model_type="no_such")
    rules, msg = check("objective=distill", f"objective.teacher={teacher}")
    assert rules and "objective.teacher=" in msg, msg


def test_mbr_check_refuses_with_exit_2_naming_the_rule(tmp_path):
    import subprocess
    import sys

    teacher = _hf_dir(tmp_path / "teacher", vocab_size=1000)
    r = subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", "check", "objective=distill", f"objective.teacher={teacher}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "[frozen-vocab]" in r.stderr and "vocab_size=1000, the student 512" in r.stderr
    assert "Traceback" not in r.stderr
