"""Fixes for megatron-core 0.16.1 bugs that hit every device (the CPU-only ones live in cpu.py).

1. Without Transformer Engine, `moe_utils` never defines `te_general_gemm`, yet the MoE
   router's gating GEMM tests `te_general_gemm is not None`: every MoE forward raises
   NameError — on a GPU without TE as on the CPU (seen on an H100, docs/benchmarks.md "GPU").
   Defining it as None takes megatron's own torch.mm path.
"""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils


def apply() -> None:
    """Idempotent; called when the process groups are set up (runtime/groups.py)."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


__all__ = ["apply"]
