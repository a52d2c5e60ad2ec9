"""The step-time model against Narayanan et al. 2021 Table 1 (plan/published.py): in-process, no Hydra."""

import pytest

from megatron_bridge.backends.describe import describe
from megatron_bridge.commands.plan import plan
from megatron_bridge.errors import UserError
from megatron_bridge.plan import comm as C
from megatron_bridge.plan.evaluation import Context
from megatron_bridge.plan.published import NARAYANAN_2021, estimate


def test_ten_published_runs_within_15_percent():
    """Every row's estimate for the published layout is within ±15% of its published time per
    iteration (benchmarks/plan_published.py prints the table in docs/plan.md)."""
    ratios = {r.billions: estimate(r).step_s / r.seconds for r in NARAYANAN_2021}
    assert all(0.85 <= x <= 1.15 for x in ratios.values()), ratios


def test_published_time_follows_the_papers_flops():
    """1T row: 3072 GPUs at 163 TFLOP/s each; the paper's eq. 3 counts 4 passes (recompute)."""
    r = NARAYANAN_2021[-1]
    assert r.seconds == pytest.approx(r.flops / (3072 * 163e12))
    assert 100 < r.seconds < 105


def test_cluster_efficiency_overrides_the_fitted_default():
    """`cluster.achieved_efficiency` replaces ACHIEVED_EFFICIENCY: half the efficiency, twice the compute."""
    r = NARAYANAN_2021[0]
    base = estimate(r)
    half = estimate(r, achieved_efficiency=C.ACHIEVED_EFFICIENCY / 2)
    assert half.compute_s == pytest.approx(2 * base.compute_s)
    assert half.step_s - half.compute_s == pytest.approx(base.step_s - base.compute_s)  # comm unchanged


def test_efficiency_outside_zero_one_is_refused():
    """Bad input: a fraction of peak outside (0, 1] is an `error:` naming the key and the fix."""
    with pytest.raises(UserError, match=r"cluster.achieved_efficiency=1.5 is not a fraction of peak"):
        plan(["recipe=tiny_llama", "cluster.achieved_efficiency=1.5"])


def test_full_recompute_is_a_fourth_pass_and_interleaving_cuts_the_bubble():
    """Full recompute re-runs the forward (4 passes instead of 3); vpp divides the bubble."""
    r = NARAYANAN_2021[-1]
    ev = estimate(r)
    assert ev.layout.recompute == "full" and ev.dims.vpp == 2
    m = ev.dims.grad_accum
    assert ev.bubble == pytest.approx((r.pp - 1) / (2 * m))
    assert C.bubble_fraction(r.pp, 1, m) == pytest.approx(2 * ev.bubble)
    cfg = r.config()
    model = describe(cfg.model)
    count = Context.from_config(cfg, model).count
    full, none = (C.step_flops(model, count, s=2048, global_batch=r.batch, recompute=x) for x in ("full", "none"))
    assert full / none == pytest.approx(4 / 3)
    assert full == pytest.approx(r.flops, rel=0.01)  # the planner's count is the paper's eq. 3
