"""Learned attention sinks (GPT-OSS `self_attn.sinks`, one logit per query head).

transformers' eager attention appends the head's sink logit as an extra column of the
scores, takes the softmax over [scores, sink] and drops that column again: each query row
gives some probability mass to "nothing". megatron-core names the same thing
`softmax_type="learnable"` (`DotProductAttention.softmax_offset`, [heads / tp], applied by
`SoftmaxOne`: cat, softmax, drop — the same computation), so the config switch and the
parameter name are megatron's; our `ContextParallelAttention` implements it (any cp, packed
sequences: the sink belongs to the query row, not to a key chunk). Split over TP by heads
(the table's `COLUMN` row). TE's attention is not used for it (`needs_own_attention`).
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature


def sink_softmax(scores, sink):
    """softmax over [scores, sink] with the sink column dropped: scores [b, np, sq, sk]
    (masked entries -inf), sink [np]."""
    import torch

    col = sink.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]


@register_feature
class AttentionSinks(Feature):
    name = "attention-sinks"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        if spec.attention_sinks:
            kw["softmax_type"] = "learnable"


__all__ = ["AttentionSinks", "sink_softmax"]
