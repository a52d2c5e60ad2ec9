"""transformers' router load-balancing loss in an hf chunk (one process, tp1, gloo): with
`output_router_logits` on, the chunk's loss and every gradient (the routers' included) equal
transformers' loss with its aux term, and that term is big enough here that leaving it out
would fail by far more than the tolerance. EP runs in tests/dist/test_train.py."""

from __future__ import annotations

import pytest

TOL = 1e-5
COEF = 0.5  # released configs use ~1e-3; large here so a missing or wrong aux term shows
ROUTER = "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def groups1():
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        yield


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The same tiny Qwen3-MoE weights (make_tiny's seed) with transformers' aux loss on and off."""
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("moe_aux")
    ids, labels = make_batch(250, batch=3)
    out = {}
    for on in (True, False):
        path = make_tiny("qwen3_moe", root / str(on), output_router_logits=on, router_aux_loss_coef=COEF)
        out[on] = (path, dict(input_ids=ids, labels=labels, **hf_reference(path, ids, labels)))
    return out


def test_the_reference_includes_a_router_aux_term_that_matters(moe):
    on, off = moe[True][1], moe[False][1]
    assert (on["logits"] - off["logits"]).abs().max() == 0  # same weights
    assert on["loss"] - off["loss"] > 100 * TOL  # COEF · aux (aux ≥ 1: its minimum at uniform routing)
    assert (on["grads"][ROUTER] - off["grads"][ROUTER]).abs().max() > 100 * TOL


@pytest.mark.parametrize("on", [True, False])
def test_loss_and_every_gradient_equal_transformers_with_its_aux_loss(on, moe, groups1):
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.parity import check_layout

    path, ref = moe[on]
    res = check_layout(
        path, Layout(), ["grads"], ref=ref, input_ids=ref["input_ids"], labels=ref["labels"], backend="hf"
    )
    assert abs(res["loss"]["value"] - ref["loss"]) < TOL, res["loss"]
    assert res["grads"]["n"] == len(ref["grads"]) and not res["grads"]["bad"], res["grads"]
    assert res["grads"]["max_abs"] < TOL, res["grads"]
