"""A megatron-core GPTModel (local spec, no Transformer Engine, fp32, CPU init) trained with
megatron DDP + megatron optimizer + `get_forward_backward_func` on CPU/gloo under real torchrun
gives, at every parallel layout, the per-step losses and grad norms of the single-process
tp1·pp1 run.

Two launches: the 1-process references (dense and MoE), which also save their initial weights,
then every parallel layout one after another in one 4-process launch; each layout loads the
reference weights sliced to its shard (see tests/dist/scripts/gpt_parity.py), so all layouts
start from identical weights and see the same global batch."""

import math

import pytest

pytestmark = pytest.mark.dist

SCRIPT = "tests/dist/scripts/gpt_parity.py"
REFERENCES = ("tp=1", "moe=1")
LAYOUTS = {
    "tp=2,dopt=1": "tp=1",  # tp2·dp2, distributed optimizer
    "pp=2": "tp=1",  # pp2·dp2, tied embeddings across stages
    "tp=2,pp=2,sp=1": "tp=1",  # tp2·pp2 with sequence parallelism (torch norms)
    "pp=2,vpp=2,batched=1,mbs=1": "tp=1",  # interleaved 1F1B, batch_p2p_comm requested
    "moe=1,ep=2,ag=1": "moe=1",  # ep2·dp4, allgather dispatcher
    "moe=1,ep=2,tp=2,sp=1": "moe=1",  # ep2·etp2·tp2·SP, alltoall dispatcher (uneven gathers)
    "moe=1,ep=2,pp=2": "moe=1",  # ep2·pp2
}

# Tolerances (relative). fp32 throughout; layouts differ only in the order in which the same
# terms are summed (TP partial matmuls + all-reduce, DP gradient averaging, micro-batch
# accumulation, pipeline stage boundaries). With identical starting weights the first step
# therefore agrees to a few ulps (fp32 eps = 1.2e-7; measured <= 1e-7 loss, <= 4e-7 grad norm).
# Afterwards Adam (lr 1e-2) divides every gradient element by its own running RMS, so elements
# whose gradient is at rounding level get O(lr) updates that depend on those rounding bits; the
# difference compounds over the 6 steps. Measured worst case by step 6: loss 2e-6 / grad norm
# 3e-5 (dense), loss 8e-6 / grad norm 7e-4 (MoE, whose top-2 routing amplifies it). The bounds
# below are ~10x that. Real bugs are far larger: without the shim's sequence-parallel norm fix
# the step-1 grad norm is off by 3e-5 and the step-2 loss by 1e-4; with batched p2p on gloo
# (no shim reroute) the grad norm is 5x too large at step 2 and 50x at step 3.
FIRST_STEP_LOSS_RTOL = 1e-6
FIRST_STEP_NORM_RTOL = 1e-5
LOSS_RTOL = {"tp=1": 2e-5, "moe=1": 1e-4}
NORM_RTOL = {"tp=1": 3e-4, "moe=1": 5e-3}


@pytest.fixture(scope="module")
def runs(torchrun, tmp_path_factory):
    init_dir = tmp_path_factory.mktemp("gpt_parity_init")
    ref = torchrun([SCRIPT, "--init", str(init_dir), "--reference", *REFERENCES], 1, timeout=300)
    par = torchrun([SCRIPT, "--init", str(init_dir), *LAYOUTS], 4, timeout=300)
    return ref[0]["layouts"], par, ref[0]


def _rel(a, b):
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("ref", REFERENCES)
def test_reference_trains(runs, ref):
    losses = runs[0][ref]["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert 6.0 < losses[0] < 6.5  # ~ln(512): random init on a 512-token vocabulary
    assert losses[-1] < losses[0] - 0.5  # it really trains (same batch every step)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(runs, layout):
    refs, ranks, _ = runs
    ref = refs[LAYOUTS[layout]]
    last_stage = [r["layouts"][layout]["losses"] for r in ranks if r["layouts"][layout]["losses"]]
    assert last_stage, "no rank on the last pipeline stage reported losses"
    assert all(ls == last_stage[0] for ls in last_stage)  # dp-averaged: same on every last stage
    losses = last_stage[0]
    assert len(losses) == len(ref["losses"])
    assert _rel(losses[0], ref["losses"][0]) <= FIRST_STEP_LOSS_RTOL, (losses, ref["losses"])
    for got, want in zip(losses, ref["losses"]):
        assert _rel(got, want) <= LOSS_RTOL[LAYOUTS[layout]], (layout, losses, ref["losses"])
    for r in ranks:  # the grad norm is global: every rank must report the reference's
        norms = r["layouts"][layout]["grad_norms"]
        assert _rel(norms[0], ref["grad_norms"][0]) <= FIRST_STEP_NORM_RTOL, (layout, norms, ref["grad_norms"])
        for got, want in zip(norms, ref["grad_norms"]):
            assert _rel(got, want) <= NORM_RTOL[LAYOUTS[layout]], (layout, r["rank"], norms, ref["grad_norms"])


def test_cpu_initialization_is_tp_invariant(runs):
    """Verified fact behind the weight loading: with use_cpu_initialization megatron draws the
    full master weight and keeps this rank's slice, so at pp=1 a tp2 model starts bitwise equal
    to the sliced tp1 model. Pipeline stages draw only their own layers (and experts only their
    local experts), so those layouts need the explicit slicing the script does."""
    _, ranks, _ = runs
    assert all(r["layouts"]["tp=2,dopt=1"]["init_diff"] == 0.0 for r in ranks)
    assert any(r["layouts"]["pp=2"]["init_diff"] > 0.0 for r in ranks)


def test_dropout_masks_replay_under_activation_recompute(runs):
    """CPU RNG tracker + CPU rng-state functions: full recompute with dropout reproduces the
    forward's dropout masks exactly (and dropout really is active)."""
    ref = runs[2]
    assert ref["recompute_grad_diff"] == 0.0
    assert ref["dropout_grad_effect"] > 1e-3
