"""SDPA for the transformers backend, with the explicit path where SDPA has no fast kernel.

On a GPU, PyTorch's fused attention kernels stop at head dim 256; above it SDPA runs its
memory-efficient or math kernel, 4.4-5.4x slower than forming the scores with matmuls (H200,
docs/benchmarks.md "GPU"). Gemma 4's global layers and DeepSeek-V4 use head dim 512. The native
backend handles this in runtime/cp_attention.py; here the same rule (`sdpa_is_slow`) picks,
per call, between transformers' SDPA function and the model's own eager function (which keeps
its soft-capping and sinks), under a registered name (`mbr_sdpa`) whose masks are SDPA's.
`implementation` chooses it only on a GPU for a model with such a head dim: elsewhere the
model keeps transformers' choice.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from megatron_bridge.runtime.cp_attention import FUSED_SDPA_MAX_HEAD_DIM, allowed_mask, sdpa_is_slow

NAME = "mbr_sdpa"
HEAD_DIM_FIELDS = ("head_dim", "global_head_dim")  # the widths SDPA sees, on a text config


def function(name: str, module: torch.nn.Module) -> Any:
    """transformers' attention function for `name`; "eager" is the model's own (soft-capping,
    sinks), from its modeling file."""
    if name != "eager":
        return ALL_ATTENTION_FUNCTIONS[name]
    return sys.modules[type(module).__module__].eager_attention_forward


def attend(module: torch.nn.Module, query, key, value, attention_mask, **kwargs: Any):
    """transformers' SDPA function, or the model's eager one where `sdpa_is_slow`: then an SDPA
    mask (bool, True = attend; None = causal, or none for a non-causal module) becomes the
    additive mask eager functions read."""
    if not sdpa_is_slow(query, key.shape[2]):
        return function("sdpa", module)(module, query, key, value, attention_mask, **kwargs)
    mask = attention_mask
    causal = kwargs.get("is_causal")
    if mask is None and (getattr(module, "is_causal", True) if causal is None else causal):
        sq, sk = query.shape[2], key.shape[2]  # the queries are the last sq of the sk positions
        pos = torch.arange(sk, device=query.device)
        causal_mask = allowed_mask(pos[sk - sq :], pos, True, None)
        assert causal_mask is not None  # causal, no window: always a mask
        mask = causal_mask[None, None]
    if mask is not None and mask.dtype == torch.bool:
        neg = torch.finfo(query.dtype).min
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, neg)
    return function("eager", module)(module, query, key, value, mask, **kwargs)


AttentionInterface.register(NAME, attend)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def implementation(config: Any, device: torch.device) -> str:
    """`mbr_sdpa` for a model on a GPU whose head dim exceeds SDPA's fused kernels, else the
    implementation transformers chose."""
    current = config._attn_implementation
    if current != "sdpa" or device.type != "cuda":
        return current
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = getattr(text, "per_layer_config", None)  # heterogeneous configs (Gemma 4): per layer
    widths = [getattr(c, f, None) for c in (list(layers) if layers else [text]) for f in HEAD_DIM_FIELDS]
    return NAME if any(isinstance(w, int) and w > FUSED_SDPA_MAX_HEAD_DIM for w in widths) else current


__all__ = ["NAME", "attend", "function", "implementation"]
