"""`train.precision=fp8`: the transformer layers' GEMMs in float8, through torchao's float8.

Each tensor-parallel linear of a transformer layer (megatron's Column/RowParallelLinear, which
the transformers backend's planned linears are too) runs its local matmul as torchao's float8
GEMM (`train.fp8_recipe`: `tensorwise`, one dynamic scale per tensor, e4m3 forward and e5m2
gradients; `rowwise`, one per row, e4m3 throughout), through runtime/tp_linear.py's seam:
what surrounds the GEMM stays megatron's (the SP all-gather of the input and the
reduce-scatter of its gradient, the TP input-gradient all-reduce, the row-parallel reduction
after), and so do the parameters, their names and every checkpoint. The rest runs in
the run's precision (bf16 on GPU, fp32 on CPU): embeddings, the LM head, norms, attention's
softmax, routers and any plain nn.Linear, a frozen weight (LoRA's base), and a linear whose
local shard is not a multiple of 16 on both sides (what the FP8 GEMM takes). On a CPU torch
runs the float8 GEMMs with float8 numerics (no speed-up): what CI checks is the arithmetic.
Transformer Engine's layers are not used (the layer specs are megatron's local ones).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_bridge.errors import UserError
from megatron_bridge.runtime.tp_linear import route, tp_linears

RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearConfig.from_recipe_name
_ALIGN = 16  # both dims of an FP8 GEMM's weight


class Float8Gemm:
    """`x @ weight.T` as torchao's float8 GEMM (dynamic scales per `recipe`), gradients too."""

    def __init__(self, recipe: str) -> None:
        if recipe not in RECIPES:
            raise UserError(f"train.fp8_recipe={recipe} is not one of {', '.join(RECIPES)}")
        try:
            from torchao.float8.config import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
        except ImportError as e:
            raise UserError(
                f"train.precision=fp8 runs its GEMMs through torchao's float8, which does not import here ({e}); "
                "install it (pip install torchao==0.18.0) or use train.precision=bf16"
            ) from None
        self.recipe = recipe
        self.config = Float8LinearConfig.from_recipe_name(recipe)
        # the per-GEMM settings torchao derives from the config (a module on meta: no memory)
        self.mm_config = Float8Linear(_ALIGN, _ALIGN, bias=False, device="meta", config=self.config).linear_mm_config
        self._mm = matmul_with_hp_or_float8_args

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._mm.apply(x, weight.t(), self.mm_config, self.config)


def _fits(lin: Any) -> bool:
    out_features, in_features = lin.weight.shape
    return bool(out_features % _ALIGN == 0 and in_features % _ALIGN == 0)


def use_fp8(chunks: Sequence[Any], layers_of: Callable[[Any], Iterable[torch.nn.Module]], recipe: str) -> str:
    """Route the TP linears of every transformer layer of `chunks` through float8 GEMMs, in place;
    the line printed once: how many, the recipe, what stays in the run's precision."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        name = torch.cuda.get_device_name()
        raise UserError(
            f"train.precision=fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell), "
            f"and this {name} has compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}; "
            "use train.precision=bf16"
        )
    gemm = Float8Gemm(recipe)
    fp8, unaligned = 0, 0
    for chunk in chunks:
        for layer in layers_of(chunk):
            for lin in tp_linears(layer):
                if not _fits(lin):
                    unaligned += 1
                    continue
                route(lin, gemm)
                fp8 += 1
    line = f"train.precision=fp8: {fp8} linear(s) of the transformer layers on this rank run float8 GEMMs (torchao, {recipe})"
    if unaligned:
        line += f"; {unaligned} left in the run's precision (a shard dim not a multiple of {_ALIGN})"
    return line + "; embeddings, LM head, norms, attention scores and routers as before"


__all__ = ["RECIPES", "Float8Gemm", "use_fp8"]
