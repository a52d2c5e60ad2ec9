"""`train.loss_chunk=N`: the LM head and the cross entropy run N sequence positions at a time,
each piece recomputed in the backward pass, so a micro-batch's whole [s, b, vocab/tp] logits —
and the fp32 copy and softmax the cross entropy keeps for its gradient — are never held at
once: one piece's are (for a 128 k vocabulary at seq 8192 that is most of the last stage's
activation memory).

Each piece runs the chunk's own output layer (its forward hooks too: logit scaling and caps,
the vocabulary-padding mask) and megatron-core's vocab-parallel cross entropy, under
`torch.utils.checkpoint`; per token the loss is the same computation, so losses equal the
unchunked ones and gradients differ only by the order their pieces are summed in. With
sequence parallelism the hidden states are gathered once first (the head then runs without
SP). A megatron-core GPTModel only: MTP, inference and calls without labels keep megatron's
own path.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch.utils.checkpoint import checkpoint


def install(model: Any, chunk: int) -> None:
    """Route `model`'s training loss through the chunked head (a no-op for chunk <= 0)."""
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
        return loss(model, kw["hidden_states"], kw["labels"], chunk, kw.get("runtime_gather_output"))

    model._postprocess = postprocess


def loss(model: Any, hidden: torch.Tensor, labels: torch.Tensor, chunk: int, gather: Any) -> torch.Tensor:
    """Per-token losses [b, s] of `hidden` [s(/tp with SP), b, h] against `labels` [b, s]."""
    layer = model.output_layer
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    sp = layer.sequence_parallel
    if sp:  # the layer's own gather would interleave the ranks' pieces: gather whole, then run without SP
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False, group=layer.tp_group)

    def piece(h: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        layer.sequence_parallel = False  # set inside: the backward's recompute runs this again
        try:
            logits, _ = layer(h, weight=weight, runtime_gather_output=gather)
        finally:
            layer.sequence_parallel = sp
        return model.compute_language_model_loss(lab, logits)

    s = hidden.shape[0]
    pieces = [
        checkpoint(piece, hidden[i : i + chunk], labels[:, i : i + chunk], use_reentrant=False)
        for i in range(0, s, chunk)
    ]
    return torch.cat(pieces, dim=1)


__all__ = ["install", "loss"]
