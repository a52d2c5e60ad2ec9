"""Linear biases' build hooks (the description, and why only all-or-none: bridge/features/bias.py).

megatron's `add_bias_linear` biases every linear of a layer at once. Expert biases scale with
the routing probability exactly as HF's (W·x + b)·p; megatron adds that bias in place onto the
expert fc2 output, which autograd forbids when the TP reduce hands its input back as is
(etp 1), so biased experts get an fc2 whose output is a fresh tensor and whose bias is not
summed over TP a second time (`FreshOutput`).
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_bridge.runtime.blocks.base import Block, register_block


class FreshOutput:
    """Mixin over a row-parallel linear whose output is never the reduce's input returned as
    is, so megatron's in-place `output += bias·prob` (MLP.forward, experts) is legal."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "bias", None) is not None:
            # megatron marks the bias `sequence_parallel`, so finalize_model_grads sums its
            # grad over TP; an expert's grad is already summed over the expert-DP group,
            # which holds those same ranks at etp 1: it would count twice (measured 2x).
            self.bias.sequence_parallel = False  # type: ignore[attr-defined]  # the linear's

    def forward(self, *args: Any, **kwargs: Any):
        out, bias = super().forward(*args, **kwargs)  # type: ignore[misc]  # the linear's
        return out.clone(), bias


@functools.cache
def expert_fc2_class(base: type) -> type:
    """`base` (a row-parallel linear) with `FreshOutput`."""
    name = f"{base.__name__}FreshOutput"
    return type(base)(
        name, (FreshOutput, base), {"__module__": __name__, "__qualname__": name, "__doc__": FreshOutput.__doc__}
    )


@register_block
class LinearBiasesBlock(Block):
    name = "linear-biases"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        if spec.attention_out_bias and spec.mlp_bias:
            kw["add_bias_linear"] = True

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        if not (spec.mlp_bias and spec.is_moe):
            return
        experts = getattr(getattr(layer_spec.submodules.mlp, "submodules", None), "experts", None)
        sub = getattr(experts, "submodules", None)
        if sub is not None and getattr(sub, "linear_fc2", None) is not None:
            sub.linear_fc2 = expert_fc2_class(sub.linear_fc2)


__all__ = ["FreshOutput", "LinearBiasesBlock", "expert_fc2_class"]
