"""Learned attention sinks (GPT-OSS `self_attn.sinks`, one logit per query head).

transformers' eager attention appends the head's sink logit as an extra column of the
scores, takes the softmax over [scores, sink] and drops that column again: each query row
gives some probability mass to "nothing". megatron-core names the same thing
`softmax_type="learnable"` (`DotProductAttention.softmax_offset`, [heads / tp], applied by
`SoftmaxOne`: cat, softmax, drop — the same computation), so the config switch and the
parameter name are megatron's; our `ContextParallelAttention` implements it
(`cp_attention.sink_attention`; any cp, packed sequences: the sink belongs to the query row,
not to a key chunk). Split over TP by heads (the table's `COLUMN` row). TE's attention is not
used for it (`needs_own_attention`). Families set `attention_sinks` in `implicit`.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.runtime.blocks.base import Block, register_block


@register_block
class AttentionSinksBlock(Block):
    name = "attention-sinks"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        if spec.attention_sinks:
            kw["softmax_type"] = "learnable"


__all__ = ["AttentionSinksBlock"]
