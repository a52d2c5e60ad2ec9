"""megatron's parallel layers in the place of transformers' modules (the transformers backend).

Each class keeps megatron's layer (its shard, its tensor-parallel attributes, its
communication in forward and backward) and speaks the module it replaces: a linear returns
the output tensor alone (megatron's return `(output, bias)`), batch-first [b, s, h] input.

Sequence parallelism (`config.sequence_parallel`): between the modules that hold split linears
the hidden states are [b, s/tp, h], this rank's slice of the sequence (dim -2: [b, s, h] or
the [tokens, h] an MoE block flattens to). megatron's SP regions split and gather dim 0 of
[s, b, h], so each class moves the sequence to the front around megatron's call. The
embedding reduce-scatters its output along the sequence, the LM head gathers its input; a
module holding `colwise` linears (attention, MLP) gets its input gathered once at its entry
(`gather_sequence`: transformers' attention views q/k/v with its input's sequence length, so
the gather cannot wait for the linear), the column linears inside then take the whole
sequence without a gradient all-reduce of their own (the gather's backward reduce-scatters the
summed input gradient), and the row linear that closes the module reduce-scatters its output.
A unit that cannot split (`plan.sp_whole`: an attention planned otherwise, a linear-attention
layer) runs whole (`whole_under_sp`): built exactly as in plain TP, its input gathered at its
entry and this rank's slice of its output kept at its exit.

| tp plan | module |
|---|---|
| `colwise` | `ColumnLinear` (gather_output=False): output features split |
| `colwise_gather_output` | `ColumnLinear` (gather_output=True): output gathered over TP |
| `rowwise` | `RowLinear` (input_is_parallel=True): input features split, output all-reduced |
| `rowwise_split_input` | `RowLinear` (input_is_parallel=False): a replicated input split first |
| `replicated_with_grad_allreduce` | the module itself, its gradients summed over TP (`sum_grad_over_tp`) |
| `mla_kv_a_proj` | the linear itself, whole; its rotary output's gradient summed over TP (`mla_kv_a_hook`) |
| `mqa_fused_qkv` | the linear itself, whole; this rank's query heads and the K/V head sliced from its output (`mqa_qkv_hooks`) |
| the embedding | `VocabEmbedding`: megatron's VocabParallelEmbedding honouring `padding_idx` |
| `embedding_rowwise` | `VocabEmbedding` over the module's own rows (no padding): ids outside this rank's rows masked, output all-reduced |
| `embedding_colwise` | `ColumnEmbedding`: every row, this rank's slice of the embedding dim; output all-gathered |
| the LM head | `LMHead`: column-parallel over the padded vocab (vocab-parallel cross entropy after) |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel import layers as mlayers
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """megatron's linears take at most 3-D inputs (their backward flattens [s, b, h]); HF
    applies some linears to 4-D ones (MLA's kv_b_proj to [b, 1, s, latent]): leading dims
    folded, the caller unfolds them."""
    return x if x.dim() <= 3 else x.reshape(1, -1, x.shape[-1])


def _unfold(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`out` with `x`'s leading dims again (where `_as_3d` folded them), never a view: HF modules
    modify some outputs in place (OLMoE's `clip_qkv` clamp_), which autograd forbids on a view
    of a custom Function's output (megatron's gather over TP returns one; so would a reshape)."""
    return _not_a_view(out.reshape(*x.shape[:-1], out.shape[-1]))


def _not_a_view(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t._base is not None else t


def _seq_first(x: torch.Tensor) -> torch.Tensor:
    """[b, s, h] or [tokens, h] -> the sequence (dim -2) first, as megatron's SP regions split it."""
    return x.movedim(-2, 0)


def _seq_back(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(0, -2)


def _sequence_parallel(layer: Any) -> bool:
    return bool(layer.config.sequence_parallel) and layer.tp_group.size() > 1


class ColumnLinear(ColumnParallelLinear):
    """An HF linear the tp plan names `colwise` / `colwise_gather_output`. Under SP its input
    is already whole (its module's `gather_sequence`), so neither megatron's gather nor its
    input-gradient all-reduce runs here: the gather's backward sums that gradient."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _sequence_parallel(self):
            self.sequence_parallel, self.disable_grad_reduce = False, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(_as_3d(x))
        return _unfold(out, x)


class RowLinear(RowParallelLinear):
    """An HF linear the tp plan names `rowwise` / `rowwise_split_input`; under SP its output
    is reduce-scattered along the sequence (megatron's), back to this rank's slice. Its output is
    never a view (`_unfold`): megatron's TP all-reduce returns its input as is (an autograd view),
    and a model that adds to it in place (Llama 4's MoE: `shared_expert(x).add_(routed)`) is
    refused by autograd."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            out, _ = super().forward(_seq_first(x))
            return _not_a_view(_seq_back(out))
        out, _ = super().forward(_as_3d(x))
        return _unfold(out, x)


class LMHead(ColumnParallelLinear):
    """The LM head over the padded vocabulary, this rank's vocab slice (tied: the embedding's
    weight is passed in when both sit on one stage)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.sequence_parallel:  # megatron's gather of the sequence, [b, s/tp, h] -> [b, s, V/tp]
            out, _ = super().forward(_seq_first(x), weight=weight)
            return _seq_back(out)
        out, _ = super().forward(x, weight=weight)
        return out


class VocabEmbedding(VocabParallelEmbedding):
    """megatron's VocabParallelEmbedding (this rank's vocab rows, output all-reduced over TP),
    with transformers' `padding_idx`: that row gets no gradient from the embedding, as in
    `nn.Embedding` (its gradient from a tied head still flows). `after` (name, module): a module
    the model's embedding runs on its lookup (Muse's `embed_norm`: backends/transformers/meta.py
    EMBEDDING_AFTER), kept under its own name and run on the looked-up embeddings."""

    def __init__(
        self,
        *args: Any,
        padding_idx: int | None = None,
        embed_scale: float | None = None,
        after: tuple[str, torch.nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.embed_scale = embed_scale  # a ScaledWordEmbedding's factor (Gemma: sqrt(hidden_size))
        self.after = None if after is None else after[0]
        if after is not None:
            self.add_module(*after)
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
        if self.reduce_scatter_embeddings and split:  # under SP: this rank's slice of the sequence
            out = _seq_back(reduce_scatter_to_sequence_parallel_region(_seq_first(out), group=self.tp_group))
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.embed_scale is not None:  # as transformers: times the scale as a tensor of the weight's dtype
            out = out * torch.tensor(self.embed_scale).to(self.weight.dtype)
        if self.after is not None:
            out = self.get_submodule(self.after)(out)
        return out


class ColumnEmbedding(torch.nn.Module):
    """`embedding_colwise` (transformers' EmbeddingParallel(shard_dim=1)): each rank holds every
    row's slice of the embedding dim and looks up its slice, the slices are all-gathered along the
    last dim (backward: each rank keeps its slice of the output gradient). For tables too large to
    split by vocab alone (Qwen4-Exp's n-gram embedding). The weight is initialised as megatron's
    split weights are (`_initialize_affine_weight_*`, looked up at call time so that
    `skip_weight_init` applies)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        config: Any,
        init_method: Any,
        tp_group: Any,
        padding_idx: int | None = None,
    ) -> None:
        super().__init__()
        tp, rank = tp_group.size(), tp_group.rank()
        if embedding_dim % tp:
            raise ValueError(f"embedding_colwise: embedding dim {embedding_dim} does not split over tp={tp}")
        self.tp_group, self.padding_idx, self.embedding_dim = tp_group, padding_idx, embedding_dim
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        local = embedding_dim // tp
        self.weight = torch.nn.Parameter(torch.empty(num_embeddings, local, device=device, dtype=config.params_dtype))
        if not config.perform_initialization:
            return
        if config.use_cpu_initialization:
            mlayers._initialize_affine_weight_cpu(
                self.weight, num_embeddings, embedding_dim, local, 1, init_method,
                params_dtype=config.params_dtype, rank=rank, world_size=tp,
            )  # fmt: skip
        else:
            mlayers._initialize_affine_weight_gpu(self.weight, init_method, partition_dim=1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        out = F.embedding(input_, self.weight, padding_idx=self.padding_idx)
        return gather_from_tensor_model_parallel_region(out, group=self.tp_group)


MEGATRON_LAYERS = (ColumnLinear, RowLinear, LMHead, VocabEmbedding, ColumnEmbedding)


def scatter_sequence(x: torch.Tensor) -> torch.Tensor:
    """Under SP: this rank's slice of whole hidden states [b, s, h] along the sequence (backward:
    the slices' gradients all-gathered, so what produced `x` gets the whole gradient on every rank)."""
    group = ps.get_tensor_model_parallel_group()
    return _seq_back(scatter_to_sequence_parallel_region(_seq_first(x), group=group))


def gather_sequence(module: torch.nn.Module) -> None:
    """Under SP: `module` (one holding `colwise` linears) runs on the whole sequence. Its
    hidden states (the first positional argument, else `hidden_states=`) are gathered along
    the sequence at its entry; backward reduce-scatters their gradient, summed over TP as
    megatron's column-parallel input gradient is. Its row linear scatters the output again."""
    group = ps.get_tensor_model_parallel_group()

    def gather(x: torch.Tensor) -> torch.Tensor:
        return _seq_back(gather_from_sequence_parallel_region(_seq_first(x), group=group))

    def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise TypeError(f"{type(mod).__name__} was called without its hidden states: no sequence to gather")
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def whole_under_sp(module: torch.nn.Module, group: Any = None) -> None:
    """Under SP: `module` (a unit `plan.sp_whole` names, built as in plain TP) runs on the
    whole sequence. Its hidden states ([b, s/tp, ...], the first positional argument, else
    `hidden_states=`) are gathered at its entry by a gather whose backward only splits, and its
    output (the first element of a tuple) is cut to this rank's slice, whose backward all-gathers:
    then the output gradient is whole and the same on every TP rank, the module's backward is
    plain TP's (its split parameters get their TP gradients, its replicated ones the whole
    gradient on every rank, so they are not marked `sequence_parallel`), and its input gradient,
    whole and the same on every rank, needs no sum, only this rank's slice. `group`: the TP group
    (megatron's by default)."""
    group = group or ps.get_tensor_model_parallel_group()

    def gather(x: torch.Tensor) -> torch.Tensor:
        whole = gather_from_sequence_parallel_region(x.movedim(1, 0), tensor_parallel_output_grad=False, group=group)
        return whole.movedim(0, 1)

    def enter(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise TypeError(f"{type(mod).__name__} was called without its hidden states: no sequence to gather")
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    def leave(_: torch.nn.Module, __: Any, out: Any) -> Any:
        first = out[0] if isinstance(out, tuple) else out
        mine = _not_a_view(scatter_to_sequence_parallel_region(first.movedim(1, 0), group=group).movedim(0, 1))
        return (mine, *out[1:]) if isinstance(out, tuple) else mine

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave)


def mla_kv_a_hook(linear: torch.nn.Module, rope_dim: int) -> None:
    """`mla_kv_a_proj`: the kv down-projection stays whole on every rank. Its output is
    [latent | rotary key]: the latent feeds the column-parallel kv_b_proj (whose input gradient
    megatron sums over TP), the rotary key goes straight to this rank's heads, so its gradient
    is summed over TP here (a gradient hook) — transformers'
    MlaKvAProjParallel. Then the weight's and the input's gradients are whole on every rank."""
    summed = _summed_over_tp()

    def hook(_: torch.nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
        latent, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
        rope = rope.clone()  # its own autograd node, so the hook sees just its gradient
        if rope.requires_grad:  # not under no_grad (evaluation)
            rope.register_hook(summed)
        return torch.cat([latent, rope], dim=-1)

    linear.register_forward_hook(hook)


def mqa_qkv_hooks(linear: torch.nn.Module, heads: int, head_dim: int) -> None:
    """`mqa_fused_qkv`: the fused [query heads..., key, value] projection stays whole; its output
    is cut to this rank's query heads followed by the one K/V head, the layout the attention
    (with its query heads divided) views. Its input is copied into the TP region (gradient
    summed over TP, as a column-parallel linear's: each rank's gradient covers its heads only);
    its weight's gradient is summed by its `grad_allreduce` kind (runtime/transformers/build.py)."""
    group = ps.get_tensor_model_parallel_group()
    tp, rank = group.size(), ps.get_tensor_model_parallel_rank()

    def enter(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (copy_to_tensor_model_parallel_region(args[0], group=group), *args[1:])

    def leave(_: torch.nn.Module, __: Any, out: torch.Tensor) -> torch.Tensor:
        return mqa_local(out, heads, head_dim, tp, rank)

    linear.register_forward_pre_hook(enter)
    linear.register_forward_hook(leave)


def mqa_local(out: torch.Tensor, heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s part of a whole [query heads..., key, value] output: its query heads, then the K/V head."""
    local = heads // tp * head_dim
    return torch.cat([out[..., rank * local : (rank + 1) * local], out[..., heads * head_dim :]], dim=-1)


def _summed_over_tp() -> Any:
    """A gradient hook: the gradient summed over TP. Not megatron's copy_to_tensor_model_parallel_region:
    its all-reduce works on `.contiguous()` and a sliced gradient (the rotary key's) is not, so
    the sum would be lost."""
    group = ps.get_tensor_model_parallel_group()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=group)
        return grad

    return hook


def sum_grad_over_tp(param: torch.nn.Parameter) -> None:
    """`replicated_with_grad_allreduce`: every TP rank holds the whole tensor but sees only its
    heads' activations, so the gradient is the sum over TP. megatron's finalize_model_grads
    sums only parameters it knows by name (q_layernorm) or marks sequence-parallel, so the sum
    happens here, as the gradient reaches the parameter (before DDP accumulates it)."""
    param.register_hook(_summed_over_tp())


__all__ = [
    "ColumnEmbedding",
    "ColumnLinear",
    "LMHead",
    "MEGATRON_LAYERS",
    "RowLinear",
    "VocabEmbedding",
    "gather_sequence",
    "mla_kv_a_hook",
    "mqa_local",
    "mqa_qkv_hooks",
    "sum_grad_over_tp",
    "whole_under_sp",
]
