"""Two engines, one interface: the runner builds an `Engine` through `make_engine` and never
asks which one it holds.

- `MegatronEngine`: megatron-core DDP + megatron optimizer (zero.stage=1 → its
  DistributedOptimizer), pipeline through `get_forward_backward_func` (1F1B, interleaved
  when vpp > 1), LR schedule from megatron-core's `OptimizerParamScheduler`.
- `DeepSpeedEngine`: `deepspeed.initialize` with ZeRO 0–3 on the same megatron-core model
  and groups (the `mpu` from runtime/groups.py), ds_config generated from the Hydra config.

Both compute the same loss — the sum of the loss-masked token cross-entropies over the global
batch divided by the number of masked tokens in it (across micro-batches, DP and CP ranks; not a
mean of per-micro-batch means, which weights short SFT batches up) — and its exact gradient, in
training steps and in forward-only evaluation alike, through the one `engine_base.forward_step` / `loss_func`
(packed SFT micro-batches through runtime/packing.py's `model_inputs`), and are
checkpointed through `state_dict()` / `load_state_dict()` (this rank's share only) plus
`write_extra()` for the files an engine keeps itself (DeepSpeed's ZeRO partitions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron_bridge.train.engine_base import Engine, MakeIterators, StepResult, model_must_fit
from megatron_bridge.train.engine_deepspeed import DeepSpeedEngine
from megatron_bridge.train.engine_megatron import MegatronEngine

ENGINES: dict[str, type[Engine]] = {"megatron": MegatronEngine, "deepspeed": DeepSpeedEngine}
"""`train.engine` → its engine. `mbr check` validates the name against
`parallel.rules.CHOICES["train.engine"]` without importing torch; tests/unit/train/test_engines.py
holds the two equal."""


def make_engine(cfg: Any, dims: Any, chunks: Sequence[torch.nn.Module], mpu: Any, *, bf16: bool, **kw: Any) -> Engine:
    """The engine `cfg.train.engine` names, around the built and initialised model chunks
    (`kw`: `Engine.__init__`'s `global_names`)."""
    return ENGINES[cfg.train.engine](cfg, dims, chunks, mpu, bf16=bf16, **kw)


__all__ = [
    "ENGINES",
    "DeepSpeedEngine",
    "Engine",
    "MakeIterators",
    "MegatronEngine",
    "StepResult",
    "model_must_fit",
    "make_engine",
]
