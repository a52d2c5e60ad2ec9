"""The gradient verdict of `mbr verify` / the matrices (runtime/parity.py): |mine - ref| <= grad_tol
+ GRAD_RTOL·|ref| element by element, the raw max-abs still reported."""

import torch

from megatron_bridge.runtime.parity import GRAD_RTOL, _compare_dict, summarize


def _report(mine, ref):
    res = _compare_dict(mine, ref, exact=False)
    rank = {"m/tp2": {"grads": res, "loss": {"value": 1.0}}}
    return res, summarize([rank], "m/tp2", ["grads"], {"grads": ref, "loss": 1.0})


def test_large_gradients_may_move_by_their_relative_rounding_small_ones_may_not():
    big, small = torch.full((4,), 2.0), torch.full((4,), 0.1)
    res, (lines, ok) = _report({"w": big + 1.5e-5}, {"w": big})  # 1.5e-5 <= 1e-5 + 2e-5
    assert ok and res["max_abs"] > 1e-5 and res["max_over"] <= 1e-5, (res, lines)
    res, (lines, ok) = _report({"w": small + 1.5e-5}, {"w": small})  # 1.5e-5 > 1e-5 + 1e-6
    assert not ok and abs(res["max_over"] - (1.5e-5 - GRAD_RTOL * 0.1)) < 1e-7, (res, lines)
    assert "FAIL" in lines[-1] and "worst w" in lines[-1]
