"""megatron's parallel layers in the place of transformers' modules (the hf backend).

Each class keeps megatron's layer (its shard, its tensor-parallel attributes, its
communication in forward and backward) and speaks the module it replaces: a linear returns
the output tensor alone (megatron's return `(output, bias)`), batch-first [b, s, h] input
(no sequence parallelism here, so megatron's layers are indifferent to the leading dims).

| tp plan | module |
|---|---|
| `colwise` | `ColumnLinear` (gather_output=False): output features split |
| `colwise_gather_output` | `ColumnLinear` (gather_output=True): output gathered over TP |
| `rowwise` | `RowLinear` (input_is_parallel=True): input features split, output all-reduced |
| `rowwise_split_input` | `RowLinear` (input_is_parallel=False): a replicated input split first |
| `replicated_with_grad_allreduce` | the module itself, its gradients summed over TP (`sum_grad_over_tp`) |
| the embedding | `VocabEmbedding`: megatron's VocabParallelEmbedding honouring `padding_idx` |
| the LM head | `LMHead`: column-parallel over the padded vocab (vocab-parallel cross entropy after) |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


class ColumnLinear(ColumnParallelLinear):
    """An HF linear the tp plan names `colwise` / `colwise_gather_output`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(x)
        return out


class RowLinear(RowParallelLinear):
    """An HF linear the tp plan names `rowwise` / `rowwise_split_input`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(x)
        return out


class LMHead(ColumnParallelLinear):
    """The LM head over the padded vocabulary, this rank's vocab slice (tied: the embedding's
    weight is passed in when both sit on one stage)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = super().forward(x, weight=weight)
        return out


class VocabEmbedding(VocabParallelEmbedding):
    """megatron's VocabParallelEmbedding (this rank's vocab rows, output all-reduced over TP),
    with transformers' `padding_idx`: that row gets no gradient from the embedding, as in
    `nn.Embedding` (its gradient from a tied head still flows)."""

    def __init__(
        self, *args: Any, padding_idx: int | None = None, embed_scale: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.embed_scale = embed_scale  # a ScaledWordEmbedding's factor (Gemma: sqrt(hidden_size))
        local = None if padding_idx is None else padding_idx - self.vocab_start_index
        self.local_padding_idx = local if local is not None and 0 <= local < self.num_embeddings_per_partition else None

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        split = self.tp_group.size() > 1
        if split:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            input_ = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        out = F.embedding(input_, self.weight, padding_idx=self.local_padding_idx)
        if split:
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.embed_scale is not None:  # as transformers: times the scale as a tensor of the weight's dtype
            out = out * torch.tensor(self.embed_scale).to(self.weight.dtype)
        return out


MEGATRON_LAYERS = (ColumnLinear, RowLinear, LMHead, VocabEmbedding)


def sum_grad_over_tp(param: torch.nn.Parameter) -> None:
    """`replicated_with_grad_allreduce`: every TP rank holds the whole tensor but sees only its
    heads' activations, so the gradient is the sum over TP. megatron's finalize_model_grads
    sums only parameters it knows by name (q_layernorm) or marks sequence-parallel, so the sum
    happens here, as the gradient reaches the parameter (before DDP accumulates it)."""
    group = ps.get_tensor_model_parallel_group()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)


__all__ = ["ColumnLinear", "LMHead", "MEGATRON_LAYERS", "RowLinear", "VocabEmbedding", "sum_grad_over_tp"]
