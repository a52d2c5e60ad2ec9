"""Expert gradients when ep = 1 and expert-TP < TP (e.g. tp2·etp1, which GPT-OSS's biased
experts require).

megatron-core marks expert parameters as expert-parallel (`allreduce=False`, reduced over the
expert-data-parallel group by DDP) only when expert_model_parallel_size > 1; at ep = 1 they
count as dense and are reduced over the dense DP group. That is right while etp = tp (the
two groups coincide), but at etp < tp the TP ranks hold whole replicas of each expert and
route different tokens through them, so their gradients must be summed over the expert-DP
group, which DDP then never does (measured: Mixtral and GPT-OSS expert grads off at tp2·etp1).
This hook marks them expert-parallel in exactly that case; every other layout is untouched.
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.runtime.blocks.base import Block, register_block


@register_block
class ExpertGradSyncBlock(Block):
    name = "expert-grad-sync"

    @classmethod
    def model(cls, spec: Any, chunk: Any) -> None:
        c = chunk.config
        if not spec.is_moe or c.expert_model_parallel_size != 1:
            return
        if (c.expert_tensor_parallel_size or c.tensor_model_parallel_size) == c.tensor_model_parallel_size:
            return
        for name, p in chunk.named_parameters():
            if ".mlp.experts." in name:
                p.allreduce = False


__all__ = ["ExpertGradSyncBlock"]
