"""What every backend's HF loader and exporter shares: this rank's coordinates and layout, the
tensors a checkpoint must fill (and the proof that it did), gathering TP shards to one rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import Coords
from megatron_bridge.bridge.lora import is_adapter_param
from megatron_bridge.errors import UserError


def current_coords(vp_stage: int | None = None) -> Coords:
    """This rank's coordinates in the initialized process groups (and virtual chunk)."""
    return Coords(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        vp_stage=vp_stage,
    )


def layout_of(chunks: Sequence[Any]) -> Layout:
    """The layout the chunks were built for (from their TransformerConfig)."""
    c = chunks[0].config
    return Layout(
        tp=c.tensor_model_parallel_size,
        pp=c.pipeline_model_parallel_size,
        cp=c.context_parallel_size,
        ep=c.expert_model_parallel_size,
        etp=c.expert_tensor_parallel_size,
        vpp=c.virtual_pipeline_model_parallel_size,
        sequence_parallel=c.sequence_parallel,
        layers_first_stage=c.num_layers_in_first_pipeline_stage,
        layers_last_stage=c.num_layers_in_last_pipeline_stage,
    )


def vp_stage_of(chunks: Sequence[Any], i: int) -> int | None:
    """The virtual pipeline stage of `chunks[i]` (None without VPP)."""
    return i if chunks[0].config.virtual_pipeline_model_parallel_size else None


def checkpoint_tensors(chunk: Any) -> dict[str, torch.Tensor]:
    """{name: tensor} of everything a weight checkpoint must fill in `chunk`: every parameter
    and every persistent buffer (a buffer derived from the config is registered
    non-persistent), LoRA adapters excepted (`lora_modules` initialises or loads them).
    A chunk built with `build_model(..., load_weights=True)` holds uninitialised memory in
    all of them until a loader writes them, which `require_all_written` then proves."""
    out = {k: p for k, p in chunk.named_parameters() if not is_adapter_param(k)}
    for mod_name, mod in chunk.named_modules():
        for b_name, b in mod._buffers.items():
            if b is not None and b_name not in mod._non_persistent_buffers_set:
                name = f"{mod_name}.{b_name}" if mod_name else b_name
                if not is_adapter_param(name):
                    out.setdefault(name, b)
    return out


def require_all_written(targets: dict[str, Any], written: set[str], source: str) -> None:
    """The guarantee that makes skipping megatron's random init safe: every tensor of
    `targets` (`checkpoint_tensors`) was written by the loader, else a UserError naming them."""
    left = sorted(set(targets) - written)
    if left:
        raise UserError(
            f"{source} left {len(left)} tensor(s) of the model unloaded (they would keep uninitialised "
            f"memory): {', '.join(left[:8])}{' ...' if len(left) > 8 else ''}"
        )


def gather_shards(t: torch.Tensor, group, everywhere: bool = False) -> list[torch.Tensor] | None:
    """All shards on the group's first rank (None elsewhere), or on every rank (`everywhere`)."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return [t.clone()]
    if everywhere:
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return parts
    dst = torch.distributed.get_global_rank(group, 0)
    me = torch.distributed.get_rank()
    out = [torch.empty_like(t) for _ in range(size)] if me == dst else None
    torch.distributed.gather(t.contiguous(), out, dst=dst, group=group)
    return out


__all__ = ["checkpoint_tensors", "current_coords", "gather_shards", "layout_of", "require_all_written", "vp_stage_of"]
