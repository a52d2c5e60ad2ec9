"""megatron-core's tensor-parallel linears with a pluggable GEMM and traceable communication.

The seam is megatron's own `_forward_impl` of Column/RowParallelLinear: the implementation
here takes its arguments and does what `linear_with_grad_accumulation_and_async_allreduce` does
for a trainable weight — under sequence parallelism all-gather the input along the sequence
(its gradient reduce-scattered back), else all-reduce the input gradient over TP when asked —
with megatron's own region functions, then `gemm(input, weight)` (+ bias). What it leaves out is
megatron's overlap of that gradient all-reduce with the weight-gradient GEMM (`async_op=True`,
which dynamo cannot trace): so a compiled layer is one graph at any TP degree
(runtime/compiled.py), and float8 GEMMs fit in unchanged (runtime/fp8.py). A frozen weight,
megatron's deferred embedding wgrad and an empty input (an expert without tokens) keep
megatron's implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input, weight) -> input @ weight.T


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x, weight.t())


def tp_linears(module: torch.nn.Module) -> Iterator[Any]:
    """The megatron TP linears in `module` (the transformers backend's planned linears are too)."""
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            yield m


def is_routed(lin: Any) -> bool:
    """Whether `lin` already runs through `route`."""
    return bool(getattr(lin._forward_impl, "routed", False))


def route(lin: Any, gemm: Gemm) -> None:
    """Run `lin`'s matmul through `gemm`, megatron's communication around it (in place)."""
    original = lin._forward_impl

    def impl(
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list | None = None,
        wgrad_deferral_limit: int | None = 0,
        async_grad_allreduce: bool | None = None,
        tp_group: Any = None,
    ) -> torch.Tensor:
        if not weight.requires_grad or grad_output_buffer is not None or input.numel() == 0:
            return original(
                input=input,
                weight=weight,
                bias=bias,
                gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad,
                sequence_parallel=sequence_parallel,
                grad_output_buffer=grad_output_buffer,
                wgrad_deferral_limit=wgrad_deferral_limit,
                tp_group=tp_group,
            )
        if sequence_parallel:  # forward all-gather of the sequence, backward reduce-scatter
            input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
        elif allreduce_dgrad:  # forward identity, backward all-reduce of the input gradient
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        out = gemm(input, weight)
        if bias is not None:
            return out + bias
        # a GEMM's output may be a view (torchao's is); the row-parallel all-reduce after writes it
        # in place, which dynamo refuses on a custom Function's view (eager autograd never sees it)
        return out.clone() if torch.compiler.is_compiling() and out._base is not None else out

    impl.routed = True  # type: ignore[attr-defined]
    lin._forward_impl = impl


__all__ = ["Gemm", "is_routed", "matmul", "route", "tp_linears"]
