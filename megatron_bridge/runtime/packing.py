"""Packed sequences (several conversations in one row, train/data/sft.py) as megatron-core runs them.

megatron-core's packed format is THD: the micro-batch flattened into one row of t = mbs·seq
tokens, described by `PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv)`.
With it, megatron's attention squeezes the batch dimension, applies rotary embeddings per
sequence (positions restart at every cu_seqlens boundary) and hands the parameters to the core
attention: on a GPU with Transformer Engine, TE's fused THD kernels (with the padding_causal
mask, which megatron's TE wrapper selects for thd); on CPU, `ContextParallelAttention`, which
builds the same block-diagonal causal mask from cu_seqlens (`segment_mask`). So the one batch
description drives both, and nothing here depends on the device. The TE path was written to
megatron-core 0.16's interface but has not been run on a GPU in this project's tests.

A batch's packing comes from its `segment_ids` [mbs, seq] (which conversation each position
belongs to; train/data/sft.py): a new sequence starts wherever the id changes or a row begins.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams


def cu_seqlens(segment_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative sequence lengths (int32, [n+1], from 0 to mbs·seq) of the flattened rows."""
    b, s = segment_ids.shape
    rows = torch.arange(b, device=segment_ids.device).unsqueeze(1) * (int(segment_ids.max()) + 1)
    flat = (segment_ids + rows).reshape(-1)  # rows never share an id
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1]
    idx = torch.nonzero(start).flatten()
    return torch.cat([idx, idx.new_tensor([flat.numel()])]).to(torch.int32)


def packed_seq_params(segment_ids: torch.Tensor):
    cu = cu_seqlens(segment_ids)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def segment_mask(cu: torch.Tensor, t: int, device=None) -> torch.Tensor:
    """Boolean [t, t], True = may attend: causal within each cu_seqlens sequence, nothing across."""
    lengths = (cu[1:] - cu[:-1]).long().to(device)
    seg = torch.repeat_interleave(torch.arange(lengths.numel(), device=device), lengths)
    i = torch.arange(t, device=device)
    return (seg[:, None] == seg[None, :]) & (i[:, None] >= i[None, :])


def model_inputs(batch: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """GPTModel's (args, kwargs) for a micro-batch: as is, or — packed — flattened to one THD row
    with its PackedSeqParams. The per-token losses come back [1, mbs·seq], in the loss mask's order."""
    seg = batch.get("segment_ids")
    images = {"images": batch["images"]} if batch.get("images") else {}  # a VLM's (transformers backend)
    if seg is None:
        return (batch["tokens"], batch["position_ids"], None), {"labels": batch["labels"], **images}

    def row(t):
        return t.reshape(1, -1)

    return (row(batch["tokens"]), row(batch["position_ids"]), None), {
        "labels": row(batch["labels"]),
        "packed_seq_params": packed_seq_params(seg),
        **images,
    }


def schedule_shape(seq_length: int, micro_batch_size: int, *, packed: bool) -> tuple[int, int]:
    """(seq_length, micro_batch_size) for megatron's pipeline schedule, whose p2p buffers have the
    activations' shape: a packed micro-batch travels as one row of mbs·seq tokens."""
    return (seq_length * micro_batch_size, 1) if packed else (seq_length, micro_batch_size)


__all__ = ["cu_seqlens", "model_inputs", "packed_seq_params", "schedule_shape", "segment_mask"]
