"""Which modules of a transformers-backend model a LoRA adapts, under PEFT's names (torch-free).

PEFT adapts the model's own modules, so an adapter is keyed by the module's name (the chunk's,
transformers' module path), not by the checkpoint tensor it is saved as (Qwen2.5-VL saves
`model.language_model.layers.*` as `model.layers.*`; a vision tower's `q_proj` is cut from its
saved `qkv`), and `peft.target_modules` matches those names. A target that also names a module
PEFT would wrap but the stages cannot adapt (a convolution, an embedding, the LM head, a linear
the plan splits in a way no LoRA layout follows) is refused naming it: adapting only the rest
would train another model than PEFT's.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_bridge.backends.transformers.meta import Meta
from megatron_bridge.bridge.lora import is_linear_row, matches
from megatron_bridge.bridge.table import Mapping, Resolved, resolve_megatron


def adapter_names(row: Resolved | Mapping) -> list[str]:
    """The module's own weight name for a row read from one checkpoint tensor; a row joined
    from several (per-expert tensors) keeps those, which are the modules'."""
    return [row.megatron] if len(row.hf) == 1 else list(row.hf)


def lora_refusals(m: Meta, table: Sequence[Mapping], targets: Sequence[str]) -> list[str]:
    """`module (class)` of each module a target names that PEFT would wrap and the stages do not
    adapt (meta.py `peft_modules`; the adaptable ones are the table's linear rows)."""
    out = []
    for module, cls in m.peft_modules.items():
        if not any(matches(module, t) for t in targets):
            continue
        row = resolve_megatron(table, f"{module}.weight")
        if row is None or not is_linear_row(row.mapping):
            out.append(f"{module} ({cls})")
    return out


__all__ = ["adapter_names", "lora_refusals"]
