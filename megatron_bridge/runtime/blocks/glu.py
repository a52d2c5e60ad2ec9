"""GPT-OSS's clamped SwiGLU: the build hook (the description: bridge/features/glu.py).

megatron-core 0.16's unfused GLU computes act(x_glu.clamp(max=c)) · (x_linear.clamp(-c, c) +
glu_linear_offset) with `activation_func_clamp_value` and `glu_linear_offset`; with
act = x·sigmoid(alpha·x) (`sigmoid_gate`) that is HF's expression term for term, so this
block only sets config.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_bridge.runtime.blocks.base import Block, register_block


def sigmoid_gate(x, alpha: float = 1.0):
    """x·sigmoid(alpha·x) (silu at alpha 1)."""
    return x * torch.sigmoid(alpha * x)


@register_block
class ClampedGLUBlock(Block):
    name = "clamped-glu"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        if spec.glu_clamp is not None:
            kw["activation_func_clamp_value"] = spec.glu_clamp
        if spec.glu_linear_offset:
            kw["glu_linear_offset"] = spec.glu_linear_offset
        if spec.glu_alpha != 1.0:
            kw["activation_func"] = functools.partial(sigmoid_gate, alpha=spec.glu_alpha)


__all__ = ["ClampedGLUBlock", "sigmoid_gate"]
