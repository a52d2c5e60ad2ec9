"""transformers' router load-balancing loss added to an hf chunk's training loss.

Where the model's config switches it on (`output_router_logits`, backends/transformers/aux.py), the chunk
records every router's logits during its forward, as transformers' output recorder does
(a forward hook on the router class, the output at the recorder's index), and with labels adds
`router_aux_loss_coef · load_balancing_loss_func(logits, num_experts, num_experts_per_tok)` to
each token's loss: the schedule's masked token sum then carries `tokens · coef · aux`, and the
global-batch mean `CE + coef · aux` — transformers' loss for a micro-batch, and under gradient
accumulation or DP the token-weighted mean of the micro-batches' aux losses (each rank's own
tokens, as transformers' Trainer under DDP). Its gradient reaches the routers through their
logits, as in transformers. No attention mask is passed: pads count, as in transformers called
without one. The chunk must hold every layer (pp=1, refused otherwise by `aux.aux_limits`).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_bridge.backends.transformers.aux import AuxSeam
from megatron_bridge.errors import UserError


class RouterAuxLoss:
    """Records the router logits of one chunk's forward and adds the aux loss to its token losses."""

    def __init__(self, seam: AuxSeam, lm: Any) -> None:
        missing = [a for a in ("router_aux_loss_coef", "num_experts", "num_experts_per_tok") if not hasattr(lm, a)]
        if missing:
            raise UserError(f"{type(lm).__name__} has no {', '.join(missing)}: its load-balancing loss cannot be added")
        self.seam = seam
        self.coef = float(lm.router_aux_loss_coef)
        self.num_experts, self.top_k = int(lm.num_experts), int(lm.num_experts_per_tok)
        self.logits: list[torch.Tensor] = []

    def attach(self, layers: torch.nn.Module) -> None:
        """Hook every router under `layers` (the chunk's decoder layers, in layer order)."""
        sub = f".{self.seam.layer_name.strip('.')}." if self.seam.layer_name else None
        for name, mod in layers.named_modules():
            if isinstance(mod, self.seam.router) and (sub is None or sub in f".{name}."):
                mod.register_forward_hook(self._record)

    def _record(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        self.logits.append(output[self.seam.index] if isinstance(output, tuple | list) else output)

    def start(self) -> None:
        self.logits = []

    def add(self, token_loss: torch.Tensor) -> torch.Tensor:
        logits, self.logits = tuple(self.logits), []
        aux = self.seam.loss_func(logits, self.num_experts, self.top_k, None)
        return token_loss + self.coef * aux.to(token_loss.dtype)


__all__ = ["RouterAuxLoss"]
