"""Tiny but complete HF models of every supported family (and of `HF_TINY`), built offline from their configs
(bridge/tiny.py: `TINY`, `COMMON`). Weights are randomised (norms around 1, biases non-zero)
so a swapped or dropped tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from megatron_bridge.backends.registry import backend_for
from megatron_bridge.bridge.tiny import COMMON, HF_TINY, TINY


def tiny_config(family: str, **overrides: Any):
    """The transformers config object of `family`'s tiny model (`overrides` win): a native
    family's (`TINY`) or a transformers-backend architecture's (`HF_TINY`, by model_type)."""
    cls_name, extra = TINY[family] if family in TINY else HF_TINY[family]
    kw = {**COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kw)


def randomize_(model, seed: int = 0, scale: float = 0.08) -> None:
    """Deterministic non-trivial weights: norms scale by 1 ± 0.2, everything else N(0, scale).

    A zero-centred norm (Gemma: x·(1 + w)) stores w, so its weights are drawn around 0, not 1:
    weights of 1 would double the activations at every norm and turn fp32 reduction-order
    noise into differences as large as the tolerances."""
    hf = model.config.to_dict()
    backend = backend_for(hf)  # the description `model.backend=auto` makes: does its norm store w in x·(1 + w)?
    part = backend.describe(hf, make_vocab_size_divisible_by=1).part if backend is not None else None
    centre = 0.0 if getattr(part, "zero_centered_norm", False) else 1.0  # a native part's setting
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(centre + 0.2 * noise)
            else:
                p.copy_(scale * noise)
        saved = model.state_dict()  # persistent buffers are weights too (DeepSeek-V3's e_score_correction_bias)
        for name, b in sorted(model.named_buffers()):
            if name in saved and b.is_floating_point():
                b.copy_(scale * torch.randn(b.shape, generator=g, dtype=torch.float32))


def make_tiny(family: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny randomised HF model of `family` to `out_dir`; returns the path."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


__all__ = ["make_tiny", "randomize_", "tiny_config"]
