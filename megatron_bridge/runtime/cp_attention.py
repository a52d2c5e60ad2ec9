"""Core attention for the local (no Transformer Engine) spec, with context parallelism.

megatron-core 0.16's local `DotProductAttention` refuses cp > 1 ("only supported by
TEDotProductAttention") and Transformer Engine needs CUDA. This module is a drop-in
`core_attention` (same constructor and forward signature) that works for any cp:

* K/V exchange by all-gather over the CP group, as in Llama 3's context parallelism: each
  rank keeps its own queries and attends to the whole sequence's keys/values. The backward
  of the all-gather is a reduce-scatter, so K/V gradients land back on their owners.
* megatron's load-balanced chunking: the sequence is cut into 2·cp chunks and CP rank r
  holds chunks r and 2·cp-1-r (`get_batch_on_this_cp_rank`). The gathered keys stay in
  rank order; the causal (and sliding-window) mask is computed from the *global* positions
  of each query and key, so no reordering is needed.
* packed sequences (THD, `PackedSeqParams` from runtime/packing.py): the causal mask is confined
  to each cu_seqlens sequence (block-diagonal), without context parallelism.
* GQA/MQA through SDPA's grouped heads (query head h reads KV head h // (heads/groups),
  megatron's and HF's convention), sliding window (`config.window_size = (W-1, 0)`, HF's
  "q - k < W"), attention dropout under the model-parallel RNG tracker.
* learned attention sinks (`config.softmax_type`, runtime/blocks/sinks.py): an explicit
  softmax over [scores, sink] instead of SDPA; per query row, so CP and THD need nothing.

Cost: one [sq_local, s] mask and one SDPA call per layer; the all-gather moves
(cp-1)/cp of the K/V. That is the right trade for CPU tests and for GPUs without TE; on
GPUs with TE, runtime/blocks/attention.py uses TE's attention instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)

from megatron_bridge.runtime.packing import segment_mask


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = torch.distributed.get_world_size(group)
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        n = torch.distributed.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n,) + tuple(grad.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def cp_positions(local_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global token positions of a CP rank's local sequence (chunks r and 2·cp-1-r)."""
    if cp_size == 1:
        return torch.arange(local_len, device=device)
    chunk = local_len // 2
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk, device=device),
            torch.arange(second * chunk, (second + 1) * chunk, device=device),
        ]
    )


def allowed_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: tuple | None) -> torch.Tensor | None:
    """Boolean [sq, sk] mask, True = may attend. None when nothing is masked."""
    if not causal and window is None:
        return None
    diff = q_pos[:, None] - k_pos[None, :]
    allowed = diff >= 0 if causal else torch.ones_like(diff, dtype=torch.bool)
    if window is not None:
        left, right = window
        if left is not None and left >= 0:
            allowed = allowed & (diff <= left)
        if right is not None and right >= 0:
            allowed = allowed & (-diff <= right)
    return allowed


def split_for_cp(t: torch.Tensor, cp_size: int, cp_rank: int, seq_dim: int = 1) -> torch.Tensor:
    """This CP rank's part of a full-sequence tensor (megatron's load-balanced chunks)."""
    if cp_size == 1:
        return t
    chunks = t.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=seq_dim)


def merge_from_cp(parts, seq_dim: int = 1) -> torch.Tensor:
    """Inverse of `split_for_cp`: the full sequence from every CP rank's part, in rank order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    # rank r holds chunks r and 2cp-1-r: the first halves in rank order, then the second halves reversed
    halves = [p.chunk(2, dim=seq_dim) for p in parts]
    return torch.cat([a for a, _ in halves] + [b for _, b in reversed(halves)], dim=seq_dim)


# PyTorch's fused attention kernels (flash, cuDNN) stop at head dim 256. Above it SDPA takes its
# memory-efficient or math kernel, which on an H200 at head dim 512 (seq 4096, bf16, forward +
# backward) ran 4.4-5.4x slower than the explicit matmuls of `eager_attention` and made the
# training step 1.72x megatron-core's local attention (docs/benchmarks.md, "GPU"). The explicit
# path holds the [b, np, sq, sk] scores, so it is taken only while those (in fp32) stay within
# EAGER_SCORES_MAX_BYTES; longer sequences keep SDPA, whose kernels never form them.
FUSED_SDPA_MAX_HEAD_DIM = 256
EAGER_SCORES_MAX_BYTES = 2**30


def sdpa_is_slow(q: torch.Tensor, sk: int) -> bool:
    """True where SDPA has no fused kernel for q [b, np, sq, hn] on a GPU (head dim over 256)
    and the explicit scores for `sk` keys fit EAGER_SCORES_MAX_BYTES. On the CPU SDPA stays:
    its kernel takes any head dim."""
    b, heads, sq, head_dim = q.shape
    return q.is_cuda and head_dim > FUSED_SDPA_MAX_HEAD_DIM and b * heads * sq * sk * 4 <= EAGER_SCORES_MAX_BYTES


def eager_attention(q, k, v, allowed, scale: float, cap: float = 0.0, dropout: float = 0.0) -> torch.Tensor:
    """Attention with the scores computed explicitly, softmax in fp32 (transformers' eager
    attention): for logit soft-capping (Gemma 2; `cap`: `cap·tanh(scores·scale/cap)` before
    the mask), which SDPA cannot do, and for head dims SDPA has no fast kernel for
    (`sdpa_is_slow`). q [b, np, sq, hn], k/v [b, ng, sk, hn] -> [b, np, sq, hn]."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # query head h reads KV head h // rep
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap:
        scores = torch.tanh(scores / cap) * cap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over [scores, sink] with the sink column dropped: scores [b, np, sq, sk]
    (masked entries -inf), sink [np] (runtime/blocks/sinks.py)."""
    col = sink.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]


def sink_attention(q, k, v, allowed, scale: float, sink: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
    """Eager attention with the sink column (transformers' eager_attention_forward): SDPA has
    no sink, so scores are formed explicitly. Rows stay finite even when every key is masked
    (the sink takes all the mass). Shapes as `eager_attention`."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = sink_softmax(scores, sink.to(q.device))
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs.to(v.dtype), v)


class ContextParallelAttention(MegatronModule):
    """Pure-PyTorch core attention, any context-parallel size (see module docstring)."""

    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        window="config",
        softcap=None,
        k_channels=None,  # MLA: q/k and v head dims differ; SDPA takes them from the tensors
        v_channels=None,
    ):
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        cp = (
            pg_collection.cp
            if pg_collection is not None and hasattr(pg_collection, "cp")
            else parallel_state.get_context_parallel_group()
        )
        self.cp_group = cp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported by ContextParallelAttention")
        self.softmax_offset = self._sinks(config, pg_collection)
        if window == "config":  # no per-layer value in the ModuleSpec params: megatron's rule
            use_window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            window = config.window_size if use_window else None
        self.window = window
        self.softcap = softcap  # attention logit soft-capping: `eager_attention` instead of SDPA
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self._causal_types = (AttnMaskType.causal,)

    @staticmethod
    def _sinks(config, pg_collection):
        """megatron's `softmax_type`: "learnable" = a sink logit per local head, a parameter
        named as DotProductAttention names it (`softmax_offset`, split over TP by heads);
        "off-by-one" = a zero sink; "vanilla" = none (runtime/blocks/sinks.py)."""
        kind = getattr(config, "softmax_type", "vanilla")
        if kind == "vanilla":
            return None
        tp = (
            torch.distributed.get_world_size(pg_collection.tp)
            if pg_collection is not None and hasattr(pg_collection, "tp")
            else parallel_state.get_tensor_model_parallel_world_size()
        )
        heads = config.num_attention_heads // tp
        if kind == "off-by-one":
            return torch.zeros(heads, dtype=config.params_dtype)
        if kind != "learnable":
            raise ValueError(f"softmax_type={kind!r} is not supported by ContextParallelAttention")
        p = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(p)
        tensor_parallel.set_tensor_model_parallel_attributes(p, True, 0, 1)
        return p

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The learnable sinks split over TP by heads, as DotProductAttention declares them
        (MegatronModule's default would call them replicated: a torch_dist checkpoint
        written at one TP could not be loaded at another)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"softmax_offset": 0},
            sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
            dp_cp_group=metadata["dp_cp_group"],
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask=None,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np·hn]; packed
        (THD, runtime/packing.py): query [t, np, hn], key/value [t, ng, hn] -> [t, 1, np·hn],
        attention causal within each cu_seqlens sequence."""
        if attention_bias is not None:
            raise NotImplementedError("attention bias needs TEDotProductAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        cp_size = torch.distributed.get_world_size(self.cp_group) if self.cp_group is not None else 1
        cp_rank = torch.distributed.get_rank(self.cp_group) if cp_size > 1 else 0
        if packed_seq_params is not None:
            query, key, value, attention_mask = self._unpack(
                query, key, value, attention_mask, packed_seq_params, cp_size
            )
        sq = query.shape[0]
        key, value, k_pos = self._gather_kv(key, value, attention_mask, cp_size, query.device)
        causal = mask_type in self._causal_types
        # The plain causal case goes to SDPA as `is_causal` with no mask: an explicit mask rules out
        # the flash kernel (and, with GQA, the memory-efficient one), which on a GPU cost 1.7x the
        # step at seq 4096 (docs/benchmarks.md, "GPU").
        plain = causal and cp_size == 1 and attention_mask is None and self.window is None and sq == key.shape[0]
        allowed = None
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        explicit = bool(self.softmax_offset is not None or self.softcap or sdpa_is_slow(q, k.shape[2]))
        if not plain or explicit:  # the explicit paths need the mask itself
            allowed = allowed_mask(cp_positions(sq, cp_size, cp_rank, query.device), k_pos, causal, self.window)
        if attention_mask is not None:  # megatron convention: True = masked out
            keep = ~attention_mask.bool()
            allowed = keep if allowed is None else keep & allowed
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0:  # attention dropout draws from megatron's model-parallel RNG
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = self._attend(q, k, v, allowed, dropout, plain, explicit)
        else:
            out = self._attend(q, k, v, allowed, dropout, plain, explicit)
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)

    @staticmethod
    def _unpack(query, key, value, attention_mask, packed_seq_params, cp_size):
        """THD inputs as a batch of one, with the block-diagonal mask of their sequences."""
        if packed_seq_params.qkv_format != "thd" or cp_size > 1 or attention_mask is not None:
            raise NotImplementedError("packed sequences: THD format without context parallelism only")
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        mask = ~segment_mask(packed_seq_params.cu_seqlens_q, query.shape[0], query.device)
        return query, key, value, mask

    def _gather_kv(self, key, value, attention_mask, cp_size: int, device):
        """(keys, values, their global positions): the whole sequence's under CP."""
        if cp_size == 1:
            return key, value, torch.arange(key.shape[0], device=device)
        if attention_mask is not None:
            raise NotImplementedError("an explicit attention_mask with cp > 1 is not supported")
        if key.shape[0] % 2:
            raise ValueError(f"local sequence length {key.shape[0]} must be even under cp={cp_size}")
        key = _GatherSeq.apply(key, self.cp_group)
        value = _GatherSeq.apply(value, self.cp_group)
        local = key.shape[0] // cp_size
        return key, value, torch.cat([cp_positions(local, cp_size, r, device) for r in range(cp_size)])

    def _attend(self, q, k, v, allowed, dropout: float, causal: bool, explicit: bool) -> torch.Tensor:
        """softmax(q·kᵀ)·v with this layer's options: sinks, else (`explicit`: soft-capping, or a
        head dim SDPA has no fast kernel for) the scores formed explicitly, else SDPA (`causal`:
        the plain causal mask, given to SDPA as `is_causal`; `allowed` is then None)."""
        if self.softmax_offset is not None:
            return sink_attention(q, k, v, allowed, self.softmax_scale, self.softmax_offset, dropout)
        if explicit:
            return eager_attention(q, k, v, allowed, self.softmax_scale, self.softcap or 0.0, dropout)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=None if causal else allowed,
            dropout_p=dropout,
            is_causal=causal,
            scale=self.softmax_scale,
            enable_gqa=gqa,
        )


__all__ = [
    "ContextParallelAttention",
    "eager_attention",
    "sink_attention",
    "sink_softmax",
    "cp_positions",
    "allowed_mask",
    "split_for_cp",
    "merge_from_cp",
]
