"""qk-norm over the whole projection (OLMo-2, OLMoE) and OLMoE's q/k/v clamp: the build
hooks (the description: bridge/features/qk_norm.py).

`qk_norm_type="head"` is megatron's own q/k layernorm: one RMSNorm of width head_dim applied
to every head. OLMo-2 and OLMoE instead apply RMSNorm to the whole q projection (width
heads·head_dim) and the whole k projection (kv_heads·head_dim), so the mean of squares runs
over all heads and the weight has one entry per (head, dim).

megatron's SelfAttention calls `q_layernorm(query)` on [sq, b, heads_local, head_dim]; with
tensor parallelism a rank holds a contiguous run of heads (the query heads of its KV groups
in order, the keys of its groups; with fewer KV heads than ranks, a copy of one group's key).
`FullQKNorm` sums its local squares and all-reduces the sum over the TP group (backward
all-reduces the gradient too: every rank's heads depend on the total; duplicated keys are
divided out). Its weight is the *whole* HF weight on every rank, of which a rank uses its
heads' rows: megatron's finalize_model_grads sums the gradient of every parameter named
`q_layernorm`/`k_layernorm` over TP (right for megatron's per-head norms, whose weight every
rank shares), and for a full weight whose other rows get no gradient on this rank that sum
is exactly the full gradient — a TP-split weight would be summed with other ranks' rows.
So the table maps these weights `REPLICATED`, and any kv_heads / tp split works.

`clip_qkv` (OLMoE): q and k clamped to [-c, c] after their norms, v after its projection,
as transformers does; done by overriding SelfAttention.get_query_key_value_tensors
(`ClippedQKV`, a mixin over whichever attention class the earlier blocks chose).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_bridge.runtime.blocks.base import Block, register_block


class AllReduceSum(torch.autograd.Function):
    """Sum over `group` in forward and in backward (every rank's output uses the sum)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class FullQKNorm(torch.nn.Module):
    """RMSNorm over all heads of q (`which="q"`) or k (`which="k"`), TP-aware. megatron norm
    signature; `hidden_size` (head_dim, what SelfAttention passes) is the width of one head,
    the heads come from the config and the TP rank."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, which: str = "q", **_: Any):
        super().__init__()
        self.eps, self.which, self.head_dim = eps, which, hidden_size
        self.tp = config.tensor_model_parallel_size
        self.heads = config.num_attention_heads if which == "q" else config.num_query_groups
        self.q_heads = config.num_attention_heads
        # every head's weight on every rank (see the module docstring)
        self.weight = torch.nn.Parameter(torch.ones(self.heads * hidden_size, dtype=config.params_dtype))

    def local_heads(self) -> tuple[int, int, int]:
        """(first head, heads, copies): the run of global heads this TP rank holds,
        and on how many ranks each of them is (keys when kv_heads < tp)."""
        if self.tp == 1:
            return 0, self.heads, 1
        r = ps.get_tensor_model_parallel_rank()
        if self.which == "q" or self.heads >= self.tp:
            n = self.heads // self.tp
            return r * n, n, 1
        copies = self.tp // self.heads  # megatron: rank r computes group r // copies
        return r // copies, 1, copies

    def forward(self, x):
        first, n, copies = self.local_heads()
        if x.shape[-2] != n:
            raise RuntimeError(f"full {self.which}-norm: {x.shape[-2]} local heads, expected {n}")
        xf = x.float()
        sq = xf.pow(2).sum(dim=(-2, -1), keepdim=True)
        if self.tp > 1:
            sq = AllReduceSum.apply(sq, ps.get_tensor_model_parallel_group()) / copies
        y = xf * torch.rsqrt(sq / (self.heads * self.head_dim) + self.eps)
        d = self.head_dim
        w = self.weight[first * d : (first + n) * d].float().view(n, d)
        return (w * y).to(x.dtype)


class ClippedQKV:
    """Mixin over an attention class (SelfAttention or a subclass): q, k (after their norms)
    and v clamped to [-clip_qkv, clip_qkv] (a constructor param)."""

    def __init__(self, *args: Any, clip_qkv: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clip_qkv = float(clip_qkv)

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        if kwargs.get("split_qkv") is False:  # megatron's fused single-qkv rope
            raise NotImplementedError("clip_qkv needs q, k, v apart: turn fused_single_qkv_rope off")
        out = super().get_query_key_value_tensors(*args, **kwargs)  # type: ignore[misc]  # the attention's
        c = self.clip_qkv
        q, k, v = (t.clamp(-c, c) for t in out[:3])
        return (q, k, v, *out[3:])


@functools.cache
def clipped_attention_class(base: type) -> type:
    """`base` (SelfAttention) whose q, k (after their norms) and v are clamped to [-c, c]."""
    name = f"ClippedQKV{base.__name__}"
    return type(base)(name, (ClippedQKV, base), {"__module__": __name__, "__qualname__": name})


@register_block
class QKNormBlock(Block):
    name = "qk-norm"

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        attn = layer_spec.submodules.self_attention
        if spec.qk_layernorm and spec.qk_norm_type == "full":
            attn.submodules.q_layernorm = ModuleSpec(module=FullQKNorm, params={"which": "q"})
            attn.submodules.k_layernorm = ModuleSpec(module=FullQKNorm, params={"which": "k"})
        if spec.clip_qkv is not None:
            attn.module = clipped_attention_class(attn.module)
            attn.params = {**(attn.params or {}), "clip_qkv": spec.clip_qkv}


__all__ = ["AllReduceSum", "ClippedQKV", "FullQKNorm", "QKNormBlock", "clipped_attention_class"]
