"""`train.loss_chunk=N`: the LM head and the cross entropy run N sequence positions at a time,
each piece recomputed in the backward pass, so a micro-batch's whole [s, b, vocab/tp] logits —
and the fp32 copy and softmax the cross entropy keeps for its gradient — are never held at
once: one piece's are (for a 128 k vocabulary at seq 8192 that is most of the last stage's
activation memory).

Each piece runs the chunk's own head — for a native GPTModel its output layer with its forward
hooks (logit scaling and caps, the vocabulary-padding mask) and megatron-core's loss; for a
transformers-backend chunk its `_logits` (the same arithmetic) and the vocab-parallel cross
entropy — under `torch.utils.checkpoint`. Per token the loss is the same computation, so losses
equal the unchunked ones and gradients differ only by the order their pieces are summed in.
With sequence parallelism the hidden states are gathered once first and the head runs without
SP (its input gradient is then all-reduced over TP, and the gather's backward only splits it).
Native: MTP, inference and calls without labels keep megatron-core's own path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch.utils.checkpoint import checkpoint


def install(model: Any, chunk: int) -> None:
    """Route a native GPTModel's training loss through the chunked head (chunk <= 0: no-op)."""
    if chunk <= 0:
        return
    megatrons = model._postprocess

    def postprocess(**kw: Any) -> Any:
        if (
            kw.get("labels") is None
            or not model.post_process
            or kw.get("mtp_in_postprocess")
            or model.config.mtp_num_layers is not None
            or kw.get("inference_context") is not None
        ):
            return megatrons(**kw)
        layer = model.output_layer
        weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
        gather = kw.get("runtime_gather_output")

        def piece(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
            logits, _ = layer(h, weight=weight, runtime_gather_output=gather)
            return model.compute_language_model_loss(lab, logits)

        return pieces(piece, kw["hidden_states"], kw["labels"], chunk, layer, seq_dim=0)

    model._postprocess = postprocess


def install_hf(chunk_module: Any, chunk: int) -> None:
    """A transformers-backend chunk (runtime/transformers/chunk.py) computes its loss in pieces."""
    chunk_module.loss_chunk = max(chunk, 0)


def pieces(
    piece: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk: int,
    layer: Any,
    *,
    seq_dim: int,
) -> torch.Tensor:
    """Per-token losses [b, s]: `piece(hidden slice, labels slice)` over the sequence, `chunk`
    positions at a time, each under checkpoint. `hidden` has the sequence at `seq_dim` (0:
    megatron's [s, b, h]; 1: transformers' [b, s, h]), split over TP when `layer` (the head, a
    ColumnParallelLinear) runs sequence-parallel; `labels` is [b, s]."""
    sp = layer.sequence_parallel
    if sp:  # the head's own gather would interleave the ranks' pieces: gather whole, run without SP
        h0 = hidden.movedim(seq_dim, 0)
        hidden = gather_from_sequence_parallel_region(h0, tensor_parallel_output_grad=False, group=layer.tp_group)
        hidden = hidden.movedim(0, seq_dim)

    def unsplit(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        layer.sequence_parallel = False  # set inside: the backward's recompute runs this again
        try:
            return piece(h, lab)
        finally:
            layer.sequence_parallel = sp

    s = hidden.shape[seq_dim]
    out = [
        checkpoint(unsplit, hidden.narrow(seq_dim, i, min(chunk, s - i)), labels[:, i : i + chunk], use_reentrant=False)
        for i in range(0, s, chunk)
    ]
    return torch.cat(out, dim=1)


__all__ = ["install", "install_hf", "pieces"]
