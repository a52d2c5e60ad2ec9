"""Expert parallelism for the transformers backend: transformers' own experts module over the EP group.

transformers' MoE blocks call their experts module as `experts(hidden [T, h], top_k_index
[T, k], top_k_weights [T, k])` with the experts' weights stacked (`gate_up_proj [E, ...]`,
`down_proj [E, ...]`; `base_model_ep_plan` names the module `ep_dispatch_experts` and its
tensors `grouped_gemm`). Under EP each rank keeps experts [r·E/ep, (r+1)·E/ep) of every
stacked tensor (dim 0) and the module's class becomes `ExpertsAllToAll`'s subclass of it: the
router (HF's, unchanged) picks experts on the token's own rank, each (token, choice) travels
to its expert's rank by all-to-all over the EP group (as megatron's
MoEAlltoAllTokenDispatcher does), the module's own forward runs its local experts with
weight 1, the outputs travel back by the reverse all-to-all and are weighted and summed per
token where the token lives. Autograd flows through both exchanges
(megatron's `tensor_parallel.mappings.all_to_all`, the dispatcher's own), so the router weights and the
activations get their gradients as in transformers.

The expert tensors are marked `allreduce=False`, megatron's mark of an expert parameter: its
DDP reduces their gradients over the expert-data-parallel group, the rest over data-parallel.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    all_to_all,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megatron_bridge.errors import UserError


class ExpertsAllToAll(torch.nn.Module):
    """Mixed into an HF experts class (`experts_class`): its forward dispatches over the EP group."""

    num_experts: int  # this rank's experts (the HF module's attribute, divided by ep)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group = ps.get_expert_model_parallel_group()
        ep, local = group.size(), self.num_experts
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        dest = torch.div(expert, local, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # (token, choice) pairs grouped by their expert's rank
        token = torch.arange(tokens, device=hidden.device).repeat_interleave(k)[order]
        send = torch.bincount(dest, minlength=ep)
        recv = torch.empty_like(send)
        torch.distributed.all_to_all_single(recv, send, group=group)
        send_n, recv_n = send.tolist(), recv.tolist()
        local_expert = torch.empty(sum(recv_n), dtype=expert.dtype, device=expert.device)
        torch.distributed.all_to_all_single(local_expert, expert[order] % local, recv_n, send_n, group=group)
        x = all_to_all(group, hidden[token], recv_n, send_n)
        ones = torch.ones(x.shape[0], 1, dtype=top_k_weights.dtype, device=x.device)
        y = super().forward(x, local_expert.unsqueeze(-1), ones)  # the HF class's own expert loop
        back = all_to_all(group, y, send_n, recv_n)
        weighted = back * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(back.dtype)
        return torch.zeros_like(hidden).index_add(0, token, weighted)


class ExpertsTP(torch.nn.Module):
    """Mixed into an HF experts class under transformers' `moe_tp_experts` at tp > 1: each TP
    rank holds every (local) expert's slice of the intermediate dimension (gate/up rows,
    down columns), the tokens are whole on every TP rank (without sequence parallelism the
    attention's row-parallel output is all-reduced), so the expert outputs are partial sums
    reduced over TP, and the inputs' gradients (hidden states and routing weights) summed
    over TP as megatron's column-parallel input does (`copy_to_tensor_model_parallel_region`)."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group = ps.get_tensor_model_parallel_group()
        x = copy_to_tensor_model_parallel_region(hidden, group=group)
        w = copy_to_tensor_model_parallel_region(top_k_weights, group=group)
        out = super().forward(x, top_k_index, w)
        return reduce_from_tensor_model_parallel_region(out, group=group)


class ExpertsSequenceTP(torch.nn.Module):
    """`ExpertsTP` under sequence parallelism: each TP rank routes its own slice of the tokens,
    so the tokens, their choices and weights are gathered over TP first (megatron's
    all-gather dispatch; backward reduce-scatters the summed input gradients), every rank runs
    its slice of every expert on all of them, and the partial outputs are reduce-scattered
    back to each rank's tokens."""

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        group = ps.get_tensor_model_parallel_group()
        x = gather_from_sequence_parallel_region(hidden, group=group)
        w = gather_from_sequence_parallel_region(top_k_weights, group=group)
        index = gather_from_sequence_parallel_region(top_k_index, group=group)
        out = super().forward(x, index, w)
        return reduce_scatter_to_sequence_parallel_region(out, group=group)


class PrescaledExpertsTP(torch.nn.Module):
    """`ExpertsTP` for experts called on pre-scaled tokens alone (Llama 4: `experts(hidden
    [E·T, h])`, every token repeated for every expert, expert-major, already multiplied by its
    router score): the same split of the intermediate dim, the same TP sum of the partial
    outputs and of the input's gradient."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        group = ps.get_tensor_model_parallel_group()
        out = super().forward(copy_to_tensor_model_parallel_region(hidden, group=group))
        return reduce_from_tensor_model_parallel_region(out, group=group)


class PrescaledExpertsSequenceTP(torch.nn.Module):
    """`PrescaledExpertsTP` under sequence parallelism: each TP rank holds [E, T/tp] of the
    expert-major tokens, so they are gathered over TP along the token dim (each expert's run
    of tokens whole), every rank runs its slice of every expert on all of them, and the
    partial outputs are reduce-scattered back along the same dim."""

    num_experts: int  # this rank's experts (the HF module's / ep; `hidden` holds every expert's run)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        group, h = ps.get_tensor_model_parallel_group(), hidden.shape[-1]
        experts = self.num_experts * ps.get_expert_model_parallel_world_size()
        x = hidden.view(experts, -1, h).transpose(0, 1).contiguous()  # [T/tp, E, h]: tokens first
        x = gather_from_sequence_parallel_region(x, group=group).transpose(0, 1).reshape(-1, h)
        out = super().forward(x).view(experts, -1, h).transpose(0, 1).contiguous()
        return reduce_scatter_to_sequence_parallel_region(out, group=group).transpose(0, 1).reshape(-1, h)


class PrescaledExpertsEP(torch.nn.Module):
    """EP for experts called on pre-scaled tokens alone (Llama 4: `experts(hidden [E·T, h])`,
    expert-major). Every expert sees every token, so there is no routing to dispatch: a fixed
    exchange. This rank's input viewed [ep, E/ep, T, h] (blocks grouped by the rank owning
    their experts) goes through one all-to-all over the EP group, the local experts run on
    [E/ep, ep·T, h] (each expert's runs from every rank end to end), and the reverse
    all-to-all brings the outputs back in the input's [E·T, h] order. Micro-batches have
    equal T on every EP rank, so the exchange's splits are equal (`exchange_order`)."""

    num_experts: int  # this rank's experts (the HF module's attribute, divided by ep)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        group = ps.get_expert_model_parallel_group()
        ep, h = group.size(), hidden.shape[-1]
        x = exchange_order(all_to_all(group, hidden.contiguous()), ep, self.num_experts, h)
        y = super().forward(x)
        return all_to_all(group, exchange_order(y, self.num_experts, ep, h))


def exchange_order(x: torch.Tensor, outer: int, inner: int, h: int) -> torch.Tensor:
    """[outer, inner, T, h] rows -> [inner, outer, T, h] rows (flat [·, h]): what arrives from
    each EP rank (source-major) made expert-major for the local experts, and (outer, inner
    swapped) their outputs back to destination-major for the reverse all-to-all."""
    return x.view(outer, inner, -1, h).transpose(0, 1).reshape(-1, h)


# how many arguments an experts module is called with -> its TP mixins (plain, sequence-parallel)
# and its EP mixin: transformers' routed call `experts(hidden, top_k_index, top_k_weights)`, or
# Llama 4's pre-scaled tokens alone (every expert sees every token: a fixed exchange)
TP_MIXINS: dict[int, tuple[type, type]] = {
    3: (ExpertsTP, ExpertsSequenceTP),
    1: (PrescaledExpertsTP, PrescaledExpertsSequenceTP),
}
EP_MIXINS: dict[int, type] = {3: ExpertsAllToAll, 1: PrescaledExpertsEP}
_CLASSES: dict[tuple[type, bool, bool, bool], type] = {}


def call_arity(cls: type) -> int:
    """How many arguments (after self) `cls.forward` takes: which TP_MIXINS entry wraps it."""
    return len(inspect.signature(cls.forward).parameters) - 1  # type: ignore[attr-defined]


def experts_class(cls: type, ep: bool, tp: bool, sp: bool = False) -> type:
    """`cls` (an HF experts class) with its forward dispatching over the EP group (`ep`)
    and/or its experts split over TP (`tp`, the tokens gathered over TP first under `sp`; the
    mixin by how `cls` is called, TP_MIXINS); its parameters, names and per-expert compute stay
    `cls`'s. One per combination (isinstance holds across chunks). TP wraps the EP dispatch."""
    key = (cls, ep, tp, sp)
    if key not in _CLASSES:
        arity = call_arity(cls)
        if tp and arity not in TP_MIXINS:
            raise UserError(
                f"{cls.__name__}.forward takes {arity} arguments; the transformers backend's `moe_tp_experts` splits "
                f"experts called with {' or '.join(map(str, TP_MIXINS))} (set tp=1)"
            )
        if ep and arity not in EP_MIXINS:
            raise UserError(
                f"{cls.__name__}.forward takes {arity} arguments; the transformers backend's `ep_dispatch_experts` "
                f"exchanges experts called with {' or '.join(map(str, EP_MIXINS))} (set ep=1)"
            )
        mixins = ((TP_MIXINS[arity][sp],) if tp else ()) + ((EP_MIXINS[arity],) if ep else ())
        name = f"{cls.__name__}{'SP' * (tp and sp)}{'TP' * tp}{'AllToAll' * ep}"
        _CLASSES[key] = type(name, (*mixins, cls), {})
    return _CLASSES[key]


def partition(experts: Any, ep: int, tp: bool, sp: bool = False) -> None:
    """Make the meta-device `experts` module this rank's E/ep of them, split over TP when
    `tp` (before materialising)."""
    if ep > 1:  # TP alone keeps every expert (LongCat-Flash's module names its count otherwise)
        experts.num_experts = int(experts.num_experts) // ep
    experts.__class__ = experts_class(type(experts), ep > 1, tp, sp)


def divide_input_by_tp(identity: torch.nn.Module) -> None:
    """`moe_identity_expert`: a zero-compute expert (nn.Identity) inside TP-split experts returns its
    input whole on every TP rank, and `ExpertsTP` sums the experts' output over TP, so its input is
    divided by tp first (its gradient too, which the TP region's copy then sums back to whole)."""
    tp = ps.get_tensor_model_parallel_world_size()
    identity.register_forward_pre_hook(lambda _, args: (args[0] / tp, *args[1:]))


def mark_expert(param: torch.nn.Parameter) -> None:
    """megatron's mark of an expert parameter: DDP reduces it over the expert-data-parallel group."""
    param.allreduce = False  # type: ignore[attr-defined]


def is_expert(param: Any) -> bool:
    return not getattr(param, "allreduce", True)


def gather_experts(t: torch.Tensor) -> torch.Tensor:
    """Collective over the EP group: the whole stacked tensor from every rank's experts, each
    rank's part broadcast into its rows (one copy of the whole, not the parts and their
    concatenation)."""
    group = ps.get_expert_model_parallel_group()
    t = t.contiguous()
    k = t.shape[0]
    whole = t.new_empty((group.size() * k, *t.shape[1:]))
    for r in range(group.size()):
        part = whole[r * k : (r + 1) * k]
        if r == group.rank():
            part.copy_(t)
        torch.distributed.broadcast(part, src=torch.distributed.get_global_rank(group, r), group=group)
    return whole


__all__ = [
    "EP_MIXINS",
    "ExpertsAllToAll",
    "ExpertsSequenceTP",
    "ExpertsTP",
    "PrescaledExpertsEP",
    "PrescaledExpertsSequenceTP",
    "PrescaledExpertsTP",
    "TP_MIXINS",
    "call_arity",
    "divide_input_by_tp",
    "exchange_order",
    "experts_class",
    "gather_experts",
    "is_expert",
    "mark_expert",
    "partition",
]
