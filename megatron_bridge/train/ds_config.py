"""The DeepSpeed config, generated from the Hydra config — never hand-written JSON.

Batch sizes come from the validated `ParallelDims` (so DeepSpeed's own batch assertion can
never disagree with ours), `zero.*` maps to `zero_optimization`, `optimizer.*` to the
optimizer block, and `zero.ds_config` (a dict) is merged last as the user's override.
The optimizer is torch's Adam (`torch_adam: true`) unless DeepSpeed's FusedAdam CUDA op is
built into the installed DeepSpeed (`fused_adam`, decided by the engine): otherwise DeepSpeed
JIT-compiles an extension on first use — on CPU longer than a short run itself
(docs/benchmarks.md), on a GPU it needs nvcc and failed on an H200 (docs/benchmarks.md, GPU).
"""

from __future__ import annotations

import copy
from typing import Any

from megatron_bridge.parallel.dims import ParallelDims


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in override.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def build_ds_config(cfg, dims: ParallelDims, *, bf16: bool, fused_adam: bool) -> dict[str, Any]:
    z, o = cfg.zero, cfg.optimizer
    zero: dict[str, Any] = {
        "stage": dims.zero_stage,
        "overlap_comm": z.overlap_comm,
        "contiguous_gradients": z.contiguous_gradients,
        "reduce_bucket_size": z.reduce_bucket_size,
        "allgather_bucket_size": z.allgather_bucket_size,
    }
    if z.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": z.offload_optimizer}
    if z.offload_param != "none":
        zero["offload_param"] = {"device": z.offload_param}
    ds: dict[str, Any] = {
        "train_batch_size": dims.global_batch_size,
        "train_micro_batch_size_per_gpu": dims.micro_batch_size,
        "gradient_accumulation_steps": dims.grad_accum,
        "gradient_clipping": o.clip_grad,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW" if o.weight_decay else "Adam",
            "params": {
                "lr": o.lr,
                "betas": [o.adam_beta1, o.adam_beta2],
                "eps": o.adam_eps,
                "weight_decay": o.weight_decay,
                "torch_adam": not fused_adam,
            },
        },
        "bf16": {"enabled": bool(bf16)},
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    }
    return _merge(ds, dict(z.ds_config or {}))
