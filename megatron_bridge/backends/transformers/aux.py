"""HF's router load-balancing loss in transformers-backend training: the seam transformers declares.

transformers' MoE causal LMs add `router_aux_loss_coef · load_balancing_loss_func(router_logits,
num_experts, num_experts_per_tok, attention_mask)` to their loss when `config.output_router_logits`
is set (off in most released config.json files: transformers then trains without it, and so does
the transformers backend). The router logits are what the base model's `_can_record_outputs["router_logits"]`
recorder captures: one output (by index) of every router module, in layer order. That recorder
and the modeling module's `load_balancing_loss_func` are the seam; a model that switches the loss
on without both is refused, naming which is missing (runtime/transformers/aux_loss.py adds the loss).

The loss couples all layers (the layer-averaged token fractions times the layer-averaged router
probabilities), so it is computed where every layer's router logits are: one pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AuxSeam:
    """Where transformers computes the aux loss of one model type."""

    loss_func: Any  # the modeling module's load_balancing_loss_func
    router: Any  # the nn.Module class whose output `index` is a layer's router logits
    index: int
    layer_name: str | None  # a recorder restricted to modules at this sub-path (mlp.gate)


def aux_enabled(cfg: Any) -> bool:
    """transformers' own switch: its CausalLM forward adds the aux loss only then."""
    return bool(getattr(cfg, "output_router_logits", False))


def aux_seam(cfg: Any) -> AuxSeam | str:
    """The seam of `cfg`'s causal LM, or what of it is missing (a refusal's words)."""
    # transformers imported here: the core imports third-party packages only inside functions
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    lm: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    func = getattr(importlib.import_module(lm.__module__), "load_balancing_loss_func", None)
    base = MODEL_MAPPING[type(cfg)] if type(cfg) in MODEL_MAPPING else None
    rec = (getattr(base, "_can_record_outputs", None) or {}).get("router_logits")
    if func is None:
        return f"{lm.__name__}'s module has no load_balancing_loss_func"
    if rec is None or isinstance(rec, list | tuple | str):
        return f"{lm.__name__}'s base model records no single router-logits output (_can_record_outputs)"
    if isinstance(rec, type):
        return AuxSeam(func, rec, 0, None)
    return AuxSeam(func, rec.target_class, rec.index, rec.layer_name)


def aux_limits(cfg: Any, pp: int) -> list[tuple[str, str]]:
    """Refusals for training with transformers' aux loss switched on (`rules` form)."""
    if not aux_enabled(cfg):
        return []
    seam = aux_seam(cfg)
    if isinstance(seam, str):
        return [
            (
                f"output_router_logits=true asks for transformers' load-balancing loss, but {seam}",
                "set output_router_logits=false in config.json (no aux loss, as transformers then trains)",
            )
        ]
    if pp > 1:
        return [
            (
                f"transformers' load-balancing loss couples every layer's router counts, which pp={pp} splits "
                "over stages (not implemented for the transformers backend yet)",
                "set parallel.pp=1, or output_router_logits=false in config.json (no aux loss)",
            )
        ]
    return []


__all__ = ["AuxSeam", "aux_enabled", "aux_limits", "aux_seam"]
