"""What every backend's builder shares: the process-group check and building without megatron's
random initialisation (runtime/build.py dispatches to the builders by `spec.backend`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from megatron.core import parallel_state as ps

from megatron_bridge.bridge.layout import Layout
from megatron_bridge.errors import UserError


def check_groups(layout: Layout) -> None:
    """The initialized megatron groups must be the layout's (built by runtime.groups)."""
    if not ps.model_parallel_is_initialized():
        raise UserError(
            "megatron-core parallel groups are not initialized; call "
            "megatron_bridge.runtime.groups.initialize(dims) first"
        )
    have = dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
    )
    want = dict(tp=layout.tp, pp=layout.pp, cp=layout.cp, ep=layout.ep, etp=layout.etp, vpp=layout.vpp)
    if (want["vpp"] or 1) == 1 and (have["vpp"] or 1) == 1:
        want["vpp"] = have["vpp"] = None
    bad = {k: (have[k], want[k]) for k in want if have[k] != want[k]}
    if bad:
        raise UserError(
            "the initialized process groups do not match the layout: "
            + ", ".join(f"{k}={h} (layout {w})" for k, (h, w) in bad.items())
        )


# megatron-core modules that call its affine-weight initialisers (imported by name there).
_INIT_MODULES = (
    "megatron.core.tensor_parallel.layers",
    "megatron.core.transformer.moe.experts",
    "megatron.core.extensions.transformer_engine",
)


@contextmanager
def skip_weight_init(active: bool = True) -> Iterator[None]:
    """While active, megatron's tensor-parallel weights are created but not initialised.

    Every TP-split weight (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
    GroupedMLP, TE linears) is initialised by `_initialize_affine_weight_cpu` — which draws
    the *full* master weight in fp32 on every rank, casts it and copies this rank's slice —
    or by `_initialize_affine_weight_gpu`. Both also set the weight's tensor-parallel
    attributes (`tensor_model_parallel`, `partition_dim`, `partition_stride`), which the
    grad-norm, the optimizer and resharding read. `perform_initialization=False` would skip
    those attributes too (megatron-core 0.16 sets them only inside the initialisers), so a
    TP-split weight would count as a duplicate; instead both initialisers are replaced by
    one that sets exactly the attributes megatron would, with megatron's own arguments.
    The small remaining inits (zero biases, router and gate weights) are untouched."""
    if not active:
        yield
        return
    layers = importlib.import_module(_INIT_MODULES[0])
    importlib.import_module(_INIT_MODULES[1])
    originals = {"_initialize_affine_weight_cpu": layers._initialize_affine_weight_cpu}
    originals["_initialize_affine_weight_gpu"] = layers._initialize_affine_weight_gpu
    set_attrs = layers.set_tensor_model_parallel_attributes

    def affine_cpu(
        weight,
        output_size,
        input_size,
        per_partition_size,
        partition_dim,
        init_method,
        stride=1,
        return_master_weight=False,
        *,
        skip_set_tensor_parallel_attributes=False,
        **_,
    ):
        if not skip_set_tensor_parallel_attributes:
            set_attrs(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)

    def affine_gpu(weight, init_method, partition_dim, stride=1, is_expert=False):
        set_attrs(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)

    replacements = {"_initialize_affine_weight_cpu": affine_cpu, "_initialize_affine_weight_gpu": affine_gpu}
    patched = []
    for mod in (sys.modules[m] for m in _INIT_MODULES if m in sys.modules):
        for name, orig in originals.items():
            if getattr(mod, name, None) is orig:
                setattr(mod, name, replacements[name])
                patched.append((mod, name, orig))
    try:
        yield
    finally:
        for mod, name, orig in patched:
            setattr(mod, name, orig)


def later(target: str) -> Callable[..., Any]:
    """`"package.module:function"`, imported at its first call. A backend's runtime half is
    declared by name in its runtime object (runtime/runtimes.py `RUNTIMES`), so a process
    that never builds one of its models never imports it: the transformers backend's pulls in transformers'
    modeling code, ~0.7 s of every launch's start-up (docs/benchmarks.md, "Start-up").
    tests/unit/test_layers.py counts a target as an import inside a function."""
    module, _, name = target.partition(":")

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = target
    return call


__all__ = ["check_groups", "later", "skip_weight_init"]
