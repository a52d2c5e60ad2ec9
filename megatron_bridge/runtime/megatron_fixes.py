"""Fixes for megatron-core 0.16.1 bugs that hit every device (the CPU-only ones live in cpu.py).

1. Without Transformer Engine, `moe_utils` never defines `te_general_gemm`, yet the MoE
   router's gating GEMM tests `te_general_gemm is not None`: every MoE forward raises
   NameError — on a GPU without TE as on the CPU (seen on an H100, docs/benchmarks.md "GPU").
   Defining it as None takes megatron's own torch.mm path.
2. `parallel_state.destroy_model_parallel()` leaves `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP`
   and its `_GLOO` copy set: a destroyed group stays referenced, and a gloo one keeps its
   transport thread until the next layout overwrites them. `forget_groups` clears every
   parallel_state global that still holds one of the groups `groups.release()` destroyed.
3. `CheckpointWithoutOutput(fp8=False)` sets `self.fp8 = fp8 is not None` (True), and its forward
   then asks Transformer Engine's `FP8GlobalStateManager`: without TE, selective recompute of
   `layernorm` raises NameError at the first step. Without TE there is no FP8 state to carry, so
   the flag is cleared after its `__init__`.
"""

from __future__ import annotations

from typing import Any

from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.moe import moe_utils


def apply() -> None:
    """Idempotent; called when the process groups are set up (runtime/groups.py)."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    ckpt = tp_random.CheckpointWithoutOutput
    if not hasattr(tp_random, "FP8GlobalStateManager") and not getattr(ckpt, "_without_te", False):
        init = ckpt.__init__

        def __init__(self: Any, fp8: Any = False) -> None:
            init(self, fp8)
            self.fp8 = False  # no Transformer Engine: no FP8 state to save or restore

        ckpt.__init__ = __init__
        ckpt._without_te = True


def forget_groups(destroyed: list) -> None:
    """Clear the parallel_state globals destroy_model_parallel left pointing at `destroyed`."""
    for name, value in list(vars(parallel_state).items()):
        if name.isupper() and any(value is pg for pg in destroyed):  # its _GROUP globals
            setattr(parallel_state, name, None)


__all__ = ["apply", "forget_groups"]
