"""runtime/fp8.py's float8 GEMM is torchao's (the same bits as its Float8Linear, forward and
gradients, for both recipes), within float8's error of the fp32 matmul; a recipe torchao does not
name is refused."""

import pytest
import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

from megatron_bridge.errors import UserError
from megatron_bridge.runtime.fp8 import RECIPES, Float8Gemm


@pytest.mark.parametrize("recipe", RECIPES)
def test_gemm_is_torchaos_float8_linear(recipe):
    torch.manual_seed(0)
    x = torch.randn(8, 4, 64, requires_grad=True)
    lin = torch.nn.Linear(64, 32, bias=False)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    ref[0].weight.data.copy_(lin.weight.data)
    convert_to_float8_training(ref, config=Float8LinearConfig.from_recipe_name(recipe))
    assert type(ref[0]).__name__ == "Float8Linear"

    x2 = x.detach().clone().requires_grad_()
    out = Float8Gemm(recipe)(x, lin.weight)
    out_ref = ref(x2)
    assert torch.equal(out, out_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    assert torch.equal(x.grad, x2.grad) and torch.equal(lin.weight.grad, ref[0].weight.grad)

    exact = x.detach() @ lin.weight.detach().t()
    err = (out.detach() - exact).norm() / exact.norm()
    assert 1e-4 < err < 0.1, err  # float8: not the fp32 product, but close to it


def test_unknown_recipe_is_refused():
    with pytest.raises(UserError, match="train.fp8_recipe=blockwise is not one of tensorwise, rowwise"):
        Float8Gemm("blockwise")
