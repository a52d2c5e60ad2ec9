"""Per-layer inputs on the transformers backend's stages (Gemma 4: `kinds.PER_LAYER_INPUTS`).

The base model computes one tensor [b, s, L, d_pl] from input_ids and the embeddings and hands
decoder layer i its slice [:, :, i]. The first stage computes it with the base model's own
methods (`get_per_layer_inputs`, `project_per_layer_inputs`) on the kept modules. The later
stages are sent it rather than recomputing it: its projection reads the embeddings, which only
the first stage holds (recomputing would put the embedding on every stage, its gradient then to
be summed over all of them, where megatron's embedding group joins only the first and last).

megatron's schedules pass one tensor [s, b, h] between stages, so the per-layer inputs travel
packed behind the hidden states, [s, b, h + L*d_pl] (`extra_width` widens the hidden_size of the
TransformerConfig the schedules read their p2p shape from); their gradient comes back the same
way. Under sequence parallelism a rank holds its slice of the sequence, so it computes the
per-layer inputs of its slice of input_ids (the modules are whole on every rank; as for any
replicated tensor on the split sequence, their gradients are summed over TP).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import parallel_state as ps

from megatron_bridge.backends.transformers.kinds import PER_LAYER_INPUTS


def extra_width(hf_config: Any) -> int:
    """How much wider than hidden_size the tensor between stages is (0 without per-layer inputs)."""
    return sum(int(hf_config.num_hidden_layers) * int(getattr(hf_config, k, 0) or 0) for k in PER_LAYER_INPUTS)


def per_layer_modules(hf_config: Any) -> tuple[str, ...]:
    """The base model's modules (attribute names) that make the per-layer inputs, where the config has them."""
    return tuple(m for k, (*_, mods) in PER_LAYER_INPUTS.items() if getattr(hf_config, k, None) for m in mods)


class PerLayerInputs:
    """The base model's per-layer-input methods bound to the kept modules. A plain object, not a
    module: the modules are registered once, at their transformers paths in the chunk (first
    stage only); the later stages use it only to unpack what they receive."""

    def __init__(self, base: Any, modules: dict[str, torch.nn.Module]) -> None:
        cfg = base.config
        (key,) = [k for k in PER_LAYER_INPUTS if getattr(cfg, k, None)]
        self.keyword = PER_LAYER_INPUTS[key][0]
        self.layers, self.width = int(cfg.num_hidden_layers), int(getattr(cfg, key))
        self.method_owner: Any = type(base)  # the base model class, whose methods take this object as `self`
        self.config = cfg
        # the constants the base model's __init__ sets next to the modules (scales, sizes)
        for k, v in vars(base).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                setattr(self, k, v)
        for name, module in modules.items():
            setattr(self, name, module)

    def compute(
        self, input_ids: torch.Tensor, embeds: torch.Tensor, tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[b, s, L, d_pl] for this rank's tokens (its sequence slice under SP), as the base model's
        forward. `tokens`: the token part a VLM's forward handed its language model (whole
        sequence; vision.PER_LAYER_TOKENS), else looked up here from input_ids."""
        n = embeds.shape[1]
        if n != input_ids.shape[1]:  # sequence parallelism: the embedding reduce-scattered the sequence
            r = ps.get_tensor_model_parallel_rank()
            input_ids = input_ids[:, r * n : (r + 1) * n]
            tokens = None if tokens is None else tokens[:, r * n : (r + 1) * n]
        owner = self.method_owner
        if tokens is None:
            tokens = owner.get_per_layer_inputs(self, input_ids, embeds)
        return owner.project_per_layer_inputs(self, embeds, tokens)

    def pack(self, h: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        """[b, s, h] and [b, s, L, d_pl] -> megatron's [s, b, h + L*d_pl]."""
        return torch.cat([h, per_layer.flatten(2)], dim=-1).transpose(0, 1).contiguous()

    def unpack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron's [s, b, h + L*d_pl] -> [b, s, h] and [b, s, L, d_pl]."""
        x = x.transpose(0, 1)
        hidden = x.shape[-1] - self.layers * self.width
        return x[..., :hidden], x[..., hidden:].unflatten(-1, (self.layers, self.width))


__all__ = ["PerLayerInputs", "extra_width", "per_layer_modules"]
