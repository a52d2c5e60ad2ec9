"""Run a bridged model: full-sequence logits and one loss/backward, under any layout.

What `mbr verify` and the parity tests need, built on megatron-core's own pipeline
schedules (`get_forward_backward_func`, so PP and interleaved VPP run exactly as in
training): each sample is one micro-batch; context parallelism splits the sequence into
megatron's load-balanced chunks before the model and puts it back together after; logits
are gathered over TP (vocab) and CP (sequence) on the last pipeline stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_bridge.runtime.cp_attention import merge_from_cp, split_for_cp


def _cp():
    return ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()


def _batches(input_ids: torch.Tensor, labels: torch.Tensor | None, images: Sequence[dict] | None = None):
    """One micro-batch per sample, already cut to this CP rank's chunks; a VLM's sample also
    carries its image inputs (`images[i]`: the keyword arguments of its forward, whole: a VLM
    runs at cp=1)."""
    cp, rank = _cp()
    b, s = input_ids.shape
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} must be divisible by 2·cp = {2 * cp}")
    pos = torch.arange(s).unsqueeze(0)
    out = []
    for i in range(b):
        mb: dict[str, Any] = {
            "input_ids": split_for_cp(input_ids[i : i + 1], cp, rank),
            "position_ids": split_for_cp(pos, cp, rank),
        }
        if labels is not None:
            mb["labels"] = split_for_cp(labels[i : i + 1], cp, rank)
        if images is not None:
            mb["images"] = images[i]
        out.append(mb)
    return out


def _to(v: Any, dev: torch.device) -> Any:
    return {k: t.to(dev) for k, t in v.items()} if isinstance(v, dict) else v.to(dev)


def _device(chunks) -> torch.device:
    return next(chunks[0].parameters()).device


def _run(
    chunks: Sequence[Any],
    input_ids: torch.Tensor,
    labels: torch.Tensor | None,
    forward_only: bool,
    on_output: Callable[[torch.Tensor, dict[str, torch.Tensor]], Any],
    images: Sequence[dict] | None = None,
) -> None:
    b, s = input_ids.shape
    pp = chunks[0].config.pipeline_model_parallel_size
    if len(chunks) > 1 and b < pp:
        raise ValueError(f"interleaved pipelining needs at least pp={pp} samples, got {b}")
    dev = _device(chunks)
    mbs = [{k: _to(v, dev) for k, v in mb.items()} for mb in _batches(input_ids, labels, images)]
    data = [iter(mbs) for _ in chunks]  # each virtual chunk walks the micro-batches itself

    def step(it, model):
        mb = next(it)
        extra = {"images": mb["images"]} if "images" in mb else {}
        out = model(mb["input_ids"], mb["position_ids"], None, labels=mb.get("labels"), **extra)
        return out, lambda output: on_output(output, mb)

    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=data if len(chunks) > 1 else data[0],
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=b,
        seq_length=s,
        micro_batch_size=1,
        forward_only=forward_only,
    )


def _gather_last(t: torch.Tensor, group) -> torch.Tensor:
    n = torch.distributed.get_world_size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


@torch.no_grad()
def forward_logits(
    chunks: Sequence[Any], input_ids: torch.Tensor, images: Sequence[dict] | None = None
) -> torch.Tensor | None:
    """Logits [b, s, padded_vocab] (fp32, CPU) for `input_ids` [b, s] (and a VLM's per-sample
    `images`); on ranks of the last pipeline stage, None elsewhere. Collective over the whole
    model-parallel group."""
    for c in chunks:
        c.eval()
    pieces: list[torch.Tensor] = []

    def keep(output, mb):
        pieces.append(output.detach().float())
        return output.sum() * 0.0, {}

    _run(chunks, input_ids, None, True, keep, images)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    cp_group = ps.get_context_parallel_group()
    cp = torch.distributed.get_world_size(cp_group)
    full = []
    for logits in pieces:  # [1, s/cp, V/tp]
        logits = _gather_last(logits, ps.get_tensor_model_parallel_group())
        if cp > 1:
            parts = [torch.empty_like(logits) for _ in range(cp)]
            torch.distributed.all_gather(parts, logits.contiguous(), group=cp_group)
            logits = merge_from_cp(parts, seq_dim=1)
        full.append(logits.cpu())
    return torch.cat(full, dim=0)


def wrap_ddp(chunks: Sequence[Any], *, distributed_optimizer: bool = False) -> list[Any]:
    """megatron DDP around each chunk (grad buffers in fp32, reduced over dp·cp, embedding
    grads shared across stages); gradients then live in `param.main_grad`. The one place the
    model is wrapped: the training engine (`distributed_optimizer` = ZeRO-1, whose buffers
    megatron's DistributedOptimizer shards) and `mbr verify` / the parity tests share it, so
    what verify checks is what training runs."""
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed_optimizer
    )
    wrapped = [DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c) for c in chunks]
    for w in wrapped:
        w.config.finalize_model_grads_func = finalize_model_grads
        w.config.no_sync_func = [x.no_sync for x in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def forward_backward(
    ddp_chunks: Sequence[Any],
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    train: bool = True,
    images: Sequence[dict] | None = None,
) -> float | None:
    """One forward/backward of the mean token cross-entropy; grads in `param.main_grad`
    (zeroed first). Returns the loss on last-stage ranks. `train=False` runs the modules in
    eval mode (same math without dropout; MoE with TP but no SP refuses training mode)."""
    for c in ddp_chunks:
        c.train(train)
        c.zero_grad_buffer()
    losses: list[torch.Tensor] = []

    def loss_fn(output, mb):
        total = output.float().sum()
        n = torch.tensor(output.numel(), dtype=torch.int, device=output.device)
        losses.append(total.detach().clone())  # the schedule rescales `total` in place
        return total, n, {"loss": total.detach().clone()}

    _run(ddp_chunks, input_ids, labels, False, loss_fn, images)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.stack(losses).sum() if losses else torch.zeros(())
    torch.distributed.all_reduce(total, group=ps.get_context_parallel_group())
    return float(total) / labels.numel()


@torch.no_grad()
def sgd_step(ddp_chunks: Sequence[Any], lr: float) -> None:
    for c in ddp_chunks:
        for p in c.parameters():
            if p.requires_grad:  # frozen tensors (DeepSeek-V3's correction bias) stay, as in megatron's optimizer
                p.data.add_(p.main_grad.to(p.dtype), alpha=-lr)


def unwrap(chunks: Sequence[Any]) -> list[Any]:
    return [getattr(c, "module", c) for c in chunks]


__all__ = ["forward_logits", "wrap_ddp", "forward_backward", "sgd_step", "unwrap"]
