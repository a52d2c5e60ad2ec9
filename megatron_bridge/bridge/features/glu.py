"""GPT-OSS's clamped SwiGLU: gate.clamp(max=c), up.clamp(-c, c),
out = (up + offset) · gate·sigmoid(alpha·gate)  (c = swiglu_limit 7, alpha 1.702, offset 1).

megatron-core 0.16's unfused GLU (`MLP.forward`, also per expert in SequentialMLP) computes
act(x_glu.clamp(max=c)) · (x_linear.clamp(-c, c) + glu_linear_offset) with
`activation_func_clamp_value` and `glu_linear_offset`; with act = x·sigmoid(alpha·x)
that is HF's expression term for term (bit-exact), so the block (runtime/blocks/glu.py) only
sets config.
megatron's own `quick_gelu` (alpha 1.702) is not used: it is `jit_fuser`-compiled, which
costs minutes of compile on CPU and rounds differently. The interleaved gate/up layout on disk is the table's business
(`stacked.ExpertsStacked`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature


@register_feature
class ClampedGLU(Feature):
    name = "clamped-glu"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        if hf.get("swiglu_limit") is not None:
            fields["glu_clamp"] = float(hf["swiglu_limit"])
        if hf.get("swiglu_alpha") is not None:
            fields["glu_alpha"] = float(hf["swiglu_alpha"])

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        if spec.glu_clamp is not None:
            cfg["swiglu_limit"] = spec.glu_clamp
        if spec.glu_clamp is not None or spec.glu_alpha != 1.0:
            cfg["swiglu_alpha"] = spec.glu_alpha


__all__ = ["ClampedGLU"]
