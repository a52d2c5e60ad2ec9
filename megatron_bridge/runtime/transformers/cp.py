"""Context parallelism for the transformers backend: an attention function in transformers' interface.

transformers lets a model pick its attention function by name (`AttentionInterface`,
`config._attn_implementation`); the model's attention modules call it with their projected,
rotated query/key/value. Under CP each rank holds megatron's two load-balanced chunks of the
sequence (runtime/schedule.py, train/data/batching.py `slice_for_cp`) and the chunk passes the
*global* positions of its tokens as position_ids, so the rotary embedding is already right; what
is left is the attention itself, done as runtime/cp_attention.py does it without TE:

* `mbr_cp_<inner>` all-gathers K/V over the CP group (backward: reduce-scatter, so the K/V
  gradients land on their owners) and hands the whole sequence's keys to the function the model
  would have used (`inner`: transformers' SDPA, or the model's own eager function, which keeps
  its soft-capping and sinks), with
* a mask from global positions (`CP_MASKS`, one per layer kind of `kinds.CP_LAYER_KINDS`): causal, and for sliding layers
  transformers' "q - k < W", in the inner function's format (boolean for SDPA, additive for eager).

Other layer kinds (linear attention, convs, sparse indexers: state or
selections over the local tokens) cannot run this way; backends/transformers/backend.py refuses them by kind.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps
from transformers import AttentionInterface

from megatron_bridge.backends.transformers.plan import CP_LAYER_KINDS
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.cp_attention import _GatherSeq, allowed_mask, cp_positions
from megatron_bridge.runtime.transformers import attention

PREFIX = "mbr_cp_"
# the attention implementations a CP function can wrap; the mask format each one reads
MASK_FORMAT = {"sdpa": "bool", "eager": "additive", attention.NAME: "bool"}


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    """[b, heads, s_local, d] -> [b, heads, s, d], ranks' chunks in rank order."""
    return _GatherSeq.apply(t.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3)


_calls = [0]  # `mbr_cp_*` calls in this process; `check_attended` compares them per forward


def check_attended(before: int, layers: int) -> None:
    """Every decoder layer of a forward must have gathered K/V here: a modeling file whose
    attention bypasses transformers' interface would attend to its local keys only, silently."""
    if _calls[0] - before < layers:
        raise UserError(
            f"{layers - _calls[0] + before} of {layers} decoder layers did not call transformers' attention "
            "interface, so context parallelism cannot reach their attention (rule backend-layout); set cp=1"
        )


def calls() -> int:
    return _calls[0]


def _attention(inner: str):
    def attend(module, query, key, value, attention_mask, **kwargs):
        _calls[0] += 1
        group = ps.get_context_parallel_group()
        return attention.function(inner, module)(
            module, query, _gather(key, group), _gather(value, group), attention_mask, **kwargs
        )

    attend.__doc__ = f"K/V gathered over the CP group, then transformers' {inner!r} attention."
    return attend


for _name in MASK_FORMAT:
    AttentionInterface.register(PREFIX + _name, _attention(_name))


def cp_implementation(current: str) -> str:
    """The registered CP name wrapping `current` (the model's attention implementation)."""
    if current not in MASK_FORMAT:
        raise ValueError(f"attention implementation {current!r} has no CP wrapper (have {tuple(MASK_FORMAT)})")
    return PREFIX + current


def _mask(window: str | None):
    """A mask function with transformers' create_*_mask keywords, for global positions."""

    def make(*, config: Any, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        cp, dev = ps.get_context_parallel_world_size(), inputs_embeds.device
        local = position_ids.shape[-1]
        k_pos = torch.cat([cp_positions(local, cp, r, dev) for r in range(cp)])
        w = getattr(config, window) if window else None
        allowed = allowed_mask(position_ids[0].to(dev), k_pos, True, (w - 1, 0) if w else None)
        assert allowed is not None
        allowed = allowed[None, None]  # [1, 1, sq, s]
        if MASK_FORMAT[config._attn_implementation.removeprefix(PREFIX)] == "bool":
            return allowed
        neg = torch.finfo(inputs_embeds.dtype).min
        return torch.zeros(allowed.shape, dtype=inputs_embeds.dtype, device=dev).masked_fill(~allowed, neg)

    return make


# layer kind -> its mask under CP (backends/transformers/kinds.py names the kinds and their windows)
CP_MASKS = {kind: _mask(window) for kind, window in CP_LAYER_KINDS.items()}

__all__ = ["CP_MASKS", "MASK_FORMAT", "calls", "check_attended", "cp_implementation"]
