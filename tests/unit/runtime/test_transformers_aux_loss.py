"""transformers' router load-balancing loss in an hf chunk (one process, tp1, gloo): with
`output_router_logits` on, the chunk's loss and every gradient (the routers' included) equal
transformers' loss with its aux term. The coefficient is large, so that leaving the term out
fails the loss, and detaching it fails the routers' gradients, by far more than the tolerance
(measured: 1.03 in the loss, > 1e-3 in the router gradients). EP runs in
tests/dist/test_train.py."""

from __future__ import annotations

import pytest
import torch

TOL = 1e-5
COEF = 0.5  # released configs use ~1e-3; large here so a missing or wrong aux term shows


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A tiny Qwen3-MoE with transformers' aux loss on, and transformers' reference."""
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.tiny import make_tiny

    ids, labels = make_batch(250, batch=3)
    path = make_tiny(
        "qwen3_moe", tmp_path_factory.mktemp("moe_aux"), output_router_logits=True, router_aux_loss_coef=COEF
    )
    return path, dict(input_ids=ids, labels=labels, **hf_reference(path, ids, labels))


def test_loss_and_every_gradient_equal_transformers_with_its_aux_loss(moe, groups1):
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.parity import check_layout

    path, ref = moe
    ce = torch.nn.functional.cross_entropy(ref["logits"].flatten(0, 1), ref["labels"].flatten())
    assert ref["loss"] - float(ce) > 100 * TOL  # COEF · aux (aux ≥ 1: its minimum is at uniform routing)
    res = check_layout(
        path, Layout(), ["grads"], ref=ref, input_ids=ref["input_ids"], labels=ref["labels"], backend="transformers"
    )
    assert abs(res["loss"]["value"] - ref["loss"]) < TOL, res["loss"]
    assert res["grads"]["n"] == len(ref["grads"]) and not res["grads"]["bad"], res["grads"]
    assert res["grads"]["max_abs"] < TOL, res["grads"]
