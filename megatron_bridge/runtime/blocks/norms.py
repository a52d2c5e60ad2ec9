"""Norms: zero-centred RMSNorm (`x·(1 + w)`, Gemma), and OLMo-2's ordering without the
input / pre-MLP norms (its norms sit on the sublayer outputs: see `sublayer.py`).

megatron's local spec builds `torch.nn.RMSNorm` (through `WrappedTorchNorm`), which has no
zero-centred form, so a spec with `zero_centered_norm` gets `BridgeRMSNorm` for every norm
of the model — input, pre-MLP, q/k, post-sublayer and final — computed in fp32 and cast back
as transformers' Gemma norms do. Weights are stored as HF stores them (`w`, not `1 + w`), so
the tables map them unchanged. Specs without these options keep megatron's modules untouched.
Families set `zero_centered_norm` / `pre_norms` in `implicit` (HF never writes them).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_layer_specs import LNImpl
from megatron.core.transformer.identity_op import IdentityOp

from megatron_bridge.runtime.blocks.base import Block, register_block


class BridgeRMSNorm(torch.nn.Module):
    """RMSNorm with an optional zero-centred weight; megatron norm signature (config,
    hidden_size, eps); marks its weight `sequence_parallel` like megatron's norms so SP
    all-reduces its gradient."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, zero_centered: bool = True, **_: Any):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        init = torch.zeros if zero_centered else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float()
        return (y * (1.0 + w) if self.zero_centered else y * w).type_as(x)


def norm_module(spec: Any) -> Any:
    """The norm class every norm of `spec` uses (megatron's own unless zero-centred)."""
    return BridgeRMSNorm if spec.zero_centered_norm else LNImpl


@register_block
class NormsBlock(Block):
    name = "norms"

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        sub = layer_spec.submodules
        if not spec.pre_norms:
            sub.input_layernorm = IdentityOp
            sub.pre_mlp_layernorm = IdentityOp
        if not spec.zero_centered_norm:
            return
        norm = norm_module(spec)
        for holder, attr in (
            (sub, "input_layernorm"),
            (sub, "pre_mlp_layernorm"),
            (sub.self_attention.submodules, "q_layernorm"),
            (sub.self_attention.submodules, "k_layernorm"),
        ):
            if getattr(holder, attr, None) is LNImpl:
                setattr(holder, attr, norm)

    @classmethod
    def block(cls, spec: Any, block_spec: Any) -> None:
        if spec.zero_centered_norm:
            block_spec.layer_norm = norm_module(spec)


__all__ = ["BridgeRMSNorm", "NormsBlock", "norm_module"]
