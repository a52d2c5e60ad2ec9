"""DeepSeek-style MoE routing's build hooks (the description, and why a router of our own:
bridge/features/moe_routing.py): `route` computes what transformers' DeepseekV2/V3TopkRouter
computes, `HFTopKRouter` is megatron's `TopKRouter` with that routing, and the layer hook puts
it into every MoE layer of a spec that needs it (`uses_hf_router`).

The correction bias (V3 `e_score_correction_bias`) is a float32 Parameter with
requires_grad=False: loaded and exported bit-exactly like any weight, never given a gradient
or touched by the optimizer, and not updated by megatron's bias update (which runs only with
moe_router_enable_expert_bias, left off).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_bridge.bridge.features.moe_routing import uses_hf_router
from megatron_bridge.runtime.blocks.base import Block, register_block


def route(
    logits,
    *,
    topk: int,
    score_function: str,
    bias=None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    renormalize: bool = True,
    scaling: float | None = None,
):
    """(probs [tokens, experts], routing_map) exactly as transformers' DeepSeek routers."""
    logits = logits.float()
    n, e = logits.shape
    sigmoid = score_function == "sigmoid"
    scores = logits.sigmoid() if sigmoid else logits.softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    source = scores
    if num_groups and group_topk:
        grouped = choice.view(n, num_groups, e // num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if sigmoid else grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(n, num_groups, e // num_groups).reshape(n, e).bool()
        choice = choice.masked_fill(~keep, float("-inf") if sigmoid else 0.0)
        if not sigmoid:
            source = choice  # V2 takes the weights from the masked scores
    idx = torch.topk(choice, k=topk, dim=-1, sorted=False)[1]
    weights = source.gather(1, idx)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling:
        weights = weights * scaling
    probs = torch.zeros_like(scores).scatter(1, idx, weights)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, idx, True)
    return probs, routing_map


class HFTopKRouter(TopKRouter):
    """TopKRouter whose routing is `route` (see module docstring)."""

    def __init__(self, *args: Any, spec: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.spec = spec
        delattr(self, "expert_bias")
        bias: Any = None
        if spec.moe_router_expert_bias:
            zeros = torch.zeros(self.config.num_moe_experts, dtype=torch.float32, device=self.weight.device)
            bias = torch.nn.Parameter(zeros, requires_grad=False)
        self.expert_bias = bias

    def _apply(self, fn, recurse=True):
        # keep the correction bias float32 through .bfloat16()/.half() (HF keeps it fp32)
        keep = self.expert_bias.data if self.expert_bias is not None else None
        out = super()._apply(fn, recurse)
        if keep is not None:
            self.expert_bias.data = keep.to(self.expert_bias.device)
        return out

    def routing(self, logits, padding_mask=None):
        s = self.spec
        return route(
            logits.view(-1, self.config.num_moe_experts),
            topk=self.topk,
            score_function=s.moe_router_score_function,
            bias=self.expert_bias,
            num_groups=s.moe_router_num_groups,
            group_topk=s.moe_router_group_topk,
            renormalize=not s.moe_router_pre_softmax,
            scaling=s.moe_router_topk_scaling_factor,
        )


@register_block
class DeepSeekRoutingBlock(Block):
    name = "moe-routing"

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        if not uses_hf_router(spec):
            return
        mlp = layer_spec.submodules.mlp
        sub = getattr(mlp, "submodules", None)
        if sub is not None and hasattr(sub, "router"):
            sub.router = functools.partial(HFTopKRouter, spec=spec)


__all__ = ["DeepSeekRoutingBlock", "HFTopKRouter", "route"]
