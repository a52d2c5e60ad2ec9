"""Build this rank's model chunks for a `BridgeSpec` under a `Layout`, by its backend.

`build_model` returns one chunk per virtual pipeline stage (a list of one without VPP), each
with pre_process/post_process set for its stage: megatron-core GPTModels for the native backend
(runtime/native/build.py), transformers' modules under megatron's parallel layers for the hf
backend (runtime/transformers/build.py). To megatron's schedules, DDP and optimizers every chunk is a
GPTModel (runtime/schedule.py runs either).
"""

from __future__ import annotations

from typing import Any

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.runtime.build_base import check_groups, skip_weight_init
from megatron_bridge.runtime.runtimes import runtime_of


def build_model(spec: BridgeSpec, layout: Layout, *, load_weights: bool = False, **config_overrides: Any) -> list[Any]:
    """This rank's model chunks for `spec` under `layout` (groups must be initialized).

    `load_weights=False` (training from scratch): the backend's random initialisation.
    `load_weights=True`: the caller is about to load every weight (`weights.load_hf_weights`,
    `load_converted.load_converted`, which prove that they did): the tensor-parallel weights
    are allocated at this rank's shard shape and left uninitialised (`skip_weight_init`),
    instead of drawing each full-size fp32 master weight and keeping a slice — the random
    init was ~80% of a tp2 build + load and a full-size weight per rank (docs/benchmarks.md).
    `config_overrides` go to TransformerConfig (params_dtype, bf16, recompute_granularity, ...).
    """
    return runtime_of(spec).build(spec, layout, load_weights=load_weights, **config_overrides)


def model_config(chunks: list[Any]):
    return chunks[0].config


__all__ = ["build_model", "check_groups", "model_config", "skip_weight_init"]
