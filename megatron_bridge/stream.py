"""Weights out of a training job in HF names, in memory-bounded buckets (RL weight sync).

Why: RL frameworks (verl, slime, NeMo-RL) push the trainer's weights into an inference engine
after every update. Handing over one tensor at a time costs a collective per tensor; handing
over a whole pipeline stage costs the stage's size in host memory. `hf_buckets` groups the
exporter's full HF tensors (`runtime.weights.iter_hf_tensors`: gathered over TP, EP and
expert-TP, merged back to HF names and shapes, either backend) into buckets of at most
`bucket_bytes`, so a receiving rank holds at most one bucket plus the one tensor that did not
fit into it, whatever the model size; `apply_bucket` copies a bucket into a transformers model
in place (the receiver side). docs/rl.md has the verl/slime-style loop.

Scope today (issue 24 item 1, first piece): the buckets arrive on the ranks that gather — per
pipeline stage its first data- and tensor-parallel rank (for MoE experts, that rank of every
expert-parallel group). Every rank must iterate `hf_buckets` to the end, as it is collective.
Not yet: a broadcast mode (every rank receives every bucket), the per-expert/fused option
(the checkpoint's layout is what comes out), the adapter-only LoRA stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from megatron_bridge.bridge.hf_config import BridgeSpec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.weights import iter_hf_tensors

Bucket = list[tuple[str, torch.Tensor]]
DEFAULT_BUCKET_BYTES = 512 << 20  # slime's default chunk size


def bucket_nbytes(bucket: Bucket) -> int:
    """The bytes a bucket's tensors hold."""
    return sum(t.numel() * t.element_size() for _, t in bucket)


def hf_buckets(
    chunks: Sequence[Any],
    spec: BridgeSpec,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> Iterator[Bucket]:
    """Collective over all ranks: yield lists of (HF name, full tensor), each holding at most
    `bucket_bytes` (a single tensor bigger than that comes alone), cast to `dtype` if given.
    A bucket is handed over as soon as the next tensor would overflow it, so the extra memory
    a rank holds is at most one bucket plus that next tensor."""
    if bucket_bytes <= 0:
        raise UserError(f"bucket_bytes must be positive, got {bucket_bytes}: pass e.g. {DEFAULT_BUCKET_BYTES}")
    bucket: Bucket = []
    size = 0
    for name, t in iter_hf_tensors(chunks, spec, dtype):
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def apply_bucket(model: torch.nn.Module, bucket: Bucket) -> int:
    """Copy a bucket into a transformers model's parameters and buffers in place (cast to each
    target's dtype and device); a name the model lacks, or a shape that differs, is an error
    before anything of the bucket is copied. Returns the number of tensors copied."""
    targets = dict(model.named_parameters()) | dict(model.named_buffers())
    missing = [n for n, _ in bucket if n not in targets]
    if missing:
        raise UserError(f"the receiving model has no tensor named {missing[:4]}: stream the same architecture")
    wrong = [(n, tuple(t.shape), tuple(targets[n].shape)) for n, t in bucket if t.shape != targets[n].shape]
    if wrong:
        raise UserError(f"streamed shape differs from the receiving model's (name, streamed, model): {wrong[:4]}")
    with torch.no_grad():
        for n, t in bucket:
            targets[n].copy_(t)
    return len(bucket)


__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "apply_bucket", "bucket_nbytes", "hf_buckets"]
