"""`mbr plan` counts the objective's frozen second model (plan/memory.py): the teacher's or the
reference's weights split as the policy's are, the teacher's logits on the last stage, and
DPO's two rows per sample. The oracles are the planner's own counts of the same model as a
policy, so the second model is provably counted as one more copy of those weights."""

import json

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.bridge.hf_config import spec_to_hf_config
from megatron_bridge.commands.plan import plan
from megatron_bridge.config.compose import compose
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.plan.evaluation import Candidate, Context, evaluate

LAYOUT = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "train.global_batch_size=8"]
PAIRS = ["objective=dpo", "data.kind=preference", "data.packing=false"]


def _stages(*overrides):
    cfg, _ = compose(["recipe=default", *LAYOUT, *overrides])
    spec = describe(cfg.model)
    ctx = Context.from_config(cfg, spec)
    dims = ParallelDims.from_config(cfg, ctx.world, moe=spec.is_moe)
    return ctx, evaluate(ctx, Candidate(dims, cfg.train.recompute), with_comm=False).stages


def _hf_dir(path, **changes):
    cfg, _ = compose(["recipe=default"])
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**spec_to_hf_config(describe(cfg.model)), **changes}))
    return path


@pytest.fixture
def student(tmp_path):
    return _hf_dir(tmp_path / "student")


def test_a_teacher_is_its_weights_as_a_policy_holds_them_and_its_logits(tmp_path):
    teacher = _hf_dir(tmp_path / "teacher", num_hidden_layers=8, hidden_size=128, intermediate_size=256)
    ctx, got = _stages("objective=distill", f"objective.teacher={teacher}")
    assert ctx.frozen_name == "teacher" and ctx.rows == 1
    cfg, _ = compose(["recipe=default", *LAYOUT])
    micro = ParallelDims.from_config(cfg, ctx.world, moe=False).grad_accum
    _, alone = _stages(f"model.hf_path={teacher}")  # the teacher trained as the policy
    _, lm = _stages()
    for g, t, s in zip(got, alone, lm, strict=True):
        assert g.frozen_weights == t.weights > s.weights  # its own layers, same TP/PP split, no ZeRO
        assert (g.grads, g.optimizer, g.activations, g.logits) == (s.grads, s.optimizer, s.activations, s.logits)
        assert g.total == pytest.approx(s.total + 1.1 * (g.frozen_weights + g.frozen_logits))
    vocab = ctx.model.padded_vocab_size(2)
    bytes_ = 4 if ctx.precision == "fp32" else 2
    # last stage, pp 2: the teacher's logits of every microbatch of the step (mbs 1, tp 2)
    assert [g.frozen_logits for g in got] == [0.0, micro * bytes_ * ctx.seq * 1 * vocab / 2]
    _, one = _stages("objective=distill", f"objective.teacher={teacher}", "parallel.pp=1")  # one microbatch's
    assert [g.frozen_logits for g in one] == [bytes_ * ctx.seq * 1 * vocab / 2]


def test_dpo_holds_a_copy_of_the_initial_policy_and_doubles_the_rows(student):
    ctx, got = _stages(*PAIRS, f"model.hf_path={student}")
    assert (ctx.frozen_name, ctx.rows) == ("reference", 2)
    _, lm = _stages(f"model.hf_path={student}")
    _, double = _stages(f"model.hf_path={student}", "train.micro_batch_size=2")  # 2 rows per microbatch
    for g, s, d in zip(got, lm, double, strict=True):
        assert g.frozen_weights == s.weights and g.frozen_logits == 0.0  # no reference logits held
        assert (g.activations, g.logits) == (d.activations, d.logits) != (s.activations, s.logits)


def test_a_reference_by_path_is_that_model(student, tmp_path):
    ref = _hf_dir(tmp_path / "ref", num_hidden_layers=2)
    _, got = _stages(*PAIRS, f"model.hf_path={student}", f"objective.reference={ref}")
    _, alone = _stages(f"model.hf_path={ref}")
    assert [g.frozen_weights for g in got] == [a.weights for a in alone]


@pytest.mark.parametrize("extra", [["peft=lora"], ["objective.loss=simpo"]], ids=["lora-base", "simpo"])
def test_no_second_copy_with_lora_or_simpo(student, extra):
    ctx, got = _stages(*PAIRS, f"model.hf_path={student}", *extra)
    assert ctx.frozen is None and ctx.frozen_name == ""
    assert all(g.frozen_weights == g.frozen_logits == 0.0 for g in got)


def test_plan_table_names_the_second_model(tmp_path):
    teacher = _hf_dir(tmp_path / "teacher")
    _, _, doc = plan(["objective=distill", f"objective.teacher={teacher}"])
    assert doc["choice"]["memory"]["frozen_model"] == "teacher"
    from megatron_bridge.plan.report import to_table

    table = to_table(doc)
    assert "teacher weights" in table and "teacher logits" in table
    _, _, doc = plan([])
    assert doc["choice"]["memory"]["frozen_model"] is None and "weights  " in to_table(doc)
    assert "teacher" not in to_table(doc) and "reference" not in to_table(doc)


def test_plan_refuses_a_bad_objective_before_the_search():
    from megatron_bridge.errors import LayoutError

    with pytest.raises(LayoutError, match=r"\[distill-teacher\]"):
        plan(["objective=distill"])


def test_mbr_check_names_the_frozen_models_memory(tmp_path, capsys):
    """`mbr check` prints the planner's count of the teacher (weights of the largest stage, logits
    of the last), and nothing for objective=lm."""
    from megatron_bridge.commands.check import main as check

    teacher = _hf_dir(tmp_path / "teacher", num_hidden_layers=8, hidden_size=128, intermediate_size=256)
    _, got = _stages("objective=distill", f"objective.teacher={teacher}")
    assert check(["recipe=default", *LAYOUT, "objective=distill", f"objective.teacher={teacher}"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("frozen teacher:"))
    weights, logits = max(g.frozen_weights for g in got), max(g.frozen_logits for g in got)
    unit, name = (2**30, "GiB") if max(weights, logits) >= 2**28 else (2**20, "MiB")
    assert f"weights {weights / unit:.1f} {name} per rank" in line and f"logits {logits / unit:.1f} {name}" in line
    assert check(["recipe=default", *LAYOUT]) == 0
    assert "frozen" not in capsys.readouterr().out
