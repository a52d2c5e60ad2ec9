"""Tiny but complete HF models of every supported family, built offline from configs.

Used by the tests and by `mbr verify --tiny FAMILY`: each config exercises what the family
is about (GQA, llama3 rope scaling, sliding window shorter than the test sequence, qkv
bias, qk-norm with head_dim != hidden/heads, tied embeddings, MoE with a dense layer and a
gated shared expert) while staying small enough for a 2-core CPU. Weights are randomised
(norms around 1, biases non-zero) so a swapped or dropped tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COMMON: dict[str, Any] = dict(
    vocab_size=250,  # not a multiple of 8·tp: exercises vocab padding
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,  # pp2·vpp2 needs 4
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _tiny_configs() -> dict[str, tuple[str, dict[str, Any]]]:
    """family -> (transformers config class, overrides of COMMON): each family class declares
    its tiny model (`FamilyBridge.tiny`) next to its table."""
    from megatron_bridge.bridge.registry import families

    return {cls.name: cls.tiny for cls in families() if cls.tiny is not None}


TINY: dict[str, tuple[str, dict[str, Any]]] = _tiny_configs()


def tiny_config(family: str, **overrides: Any):
    import transformers

    cls_name, extra = TINY[family]
    kw = {**COMMON, **extra, **overrides}
    return getattr(transformers, cls_name)(**kw)


def randomize_(model, seed: int = 0, scale: float = 0.08) -> None:
    """Deterministic non-trivial weights: norms scale by 1 ± 0.2, everything else N(0, scale).

    A zero-centred norm (Gemma: x·(1 + w)) stores w, so its weights are drawn around 0, not 1:
    weights of 1 would double the activations at every norm and turn fp32 reduction-order
    noise into differences as large as the tolerances."""
    import torch

    from megatron_bridge.bridge.hf_config import spec_from_hf

    centre = 0.0 if spec_from_hf(model.config.to_dict()).zero_centered_norm else 1.0
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
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


__all__ = ["TINY", "COMMON", "tiny_config", "randomize_", "make_tiny"]
