"""The frozen second model of `objective=dpo` (the reference) and `objective=distill` (the
teacher): built by the policy's backend under the policy's own TP/PP/EP layout and precision,
its weights loaded from an HF directory or a converted / Megatron-written checkpoint, no
gradients and no optimizer state; run forward-only through megatron-core's pipeline schedule
over the same micro-batches the policy is about to train on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_bridge.runtime.build import build_model
from megatron_bridge.runtime.packing import schedule_shape
from megatron_bridge.train.data.sft import is_packed
from megatron_bridge.train.init import load_initial_weights
from megatron_bridge.train.objectives.base import batch_to


def frozen_model(spec: Any, dims: Any, path: str, *, overrides: dict[str, Any]) -> list[Any]:
    """This rank's chunks of the model `spec` describes (backends/frozen_model.py: a teacher may be
    deeper or wider than the student), its weights read from `path`."""
    chunks = build_model(spec, dims, load_weights=True, **overrides)
    load_initial_weights(chunks, spec, path)
    for c in chunks:
        c.requires_grad_(False)
        c.eval()
    return chunks


class FrozenPass:
    """Forward-only passes of frozen `chunks` (or of the policy's own, with `context` entered:
    LoRA's adapters off) collecting `collect(batch, output)` per micro-batch on the last stage."""

    def __init__(
        self,
        chunks: Sequence[Any],
        cfg: Any,
        dims: Any,
        rows: int,
        *,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.chunks, self.cfg, self.dims, self.rows, self.context = list(chunks), cfg, dims, rows, context

    @torch.no_grad()
    def one(self, batch: dict[str, Any], forward: Callable[[Any, dict[str, Any]], torch.Tensor]) -> torch.Tensor:
        """`forward`'s output for one micro-batch already on its device, without pipeline
        parallelism (one chunk holds the whole model)."""
        with self.context():
            return forward(self.chunks[0], batch).detach()

    @torch.no_grad()
    def run(
        self,
        batches: list[dict[str, Any]],
        forward: Callable[[Any, dict[str, Any]], torch.Tensor],
        collect: Callable[[dict[str, Any], torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """`collect`'s tensors, one per micro-batch in order, on last-stage ranks (empty elsewhere)."""
        device = next(self.chunks[0].parameters()).device
        out: list[torch.Tensor] = []

        def step(it: Iterator[dict[str, Any]], model: Any):
            b = batch_to(next(it), device)
            output = forward(model, b)

            def keep(o: torch.Tensor):
                out.append(collect(b, o).detach())
                return o.float().sum() * 0.0, {}

            return output, keep

        was = [c.training for c in self.chunks]
        d = self.dims
        seq, mbs = schedule_shape(
            self.cfg.train.seq_length // d.cp, d.micro_batch_size * self.rows, packed=is_packed(self.cfg.data)
        )
        try:
            for c in self.chunks:
                c.eval()
            with self.context():
                its = [iter(batches) for _ in self.chunks]
                get_forward_backward_func()(
                    forward_step_func=step,
                    data_iterator=its if len(its) > 1 else its[0],
                    model=self.chunks if len(self.chunks) > 1 else self.chunks[0],
                    num_microbatches=len(batches),
                    seq_length=seq,
                    micro_batch_size=mbs,
                    forward_only=True,
                )
        finally:
            for c, w in zip(self.chunks, was):
                c.train(w)
        return out


__all__ = ["FrozenPass", "frozen_model"]
