"""What the CPU shim (`cpu.py`) patches in megatron-core, declared, and the checks on it.

The shim replaces or wraps private functions and methods, so it depends on megatron-core's
internals. Declaring every target here lets `install()` resolve all of them before patching
anything (a megatron-core that moved one is refused with one message naming it, never left
half-patched) and lets tests/unit/runtime/test_cpu_shim.py assert they all exist in the installed
version. Importing this module imports neither torch nor megatron-core.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import warnings
from typing import Any

WRITTEN_FOR = "0.16"  # the megatron-core minor version the patches were written for and verified on
# (numbers: the sections of cpu.py's docstring)
# 3. functions and methods that run with `Tensor.cuda()` / `Tensor.type()` looking like CUDA
CUDA_VIEW = (
    "megatron.core.models.common.language_module.language_module:LanguageModule.setup_embeddings_and_output_layer",
    "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.optimizer:MegatronOptimizer.restore_from_cpu",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.__init__",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
    "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.get_parameter_state_dp_zero",
    "megatron.core.optimizer.grad_scaler:DynamicGradScaler.load_state_dict",
    "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32",
    "megatron.core.tensor_parallel.data:broadcast_data",
    "megatron.core.utils:check_param_hashes_across_dp_replicas",
    "megatron.core.models.common.embeddings.rope_utils:get_pos_emb_on_this_cp_rank",  # CP: `.cuda()` on an index
)
# "module:attribute.path" of everything install() replaces or wraps (module only: it must import)
PATCH_TARGETS = CUDA_VIEW + (
    "megatron.core.tensor_parallel.random:CudaRNGStatesTracker",  # 2.
    "megatron.core.tensor_parallel.random:_get_cuda_rng_state",
    "megatron.core.tensor_parallel.random:_set_cuda_rng_state",
    "megatron.core.tensor_parallel.random:initialize_rng_tracker",
    "megatron.core.tensor_parallel.random:model_parallel_cuda_manual_seed",  # called on the patched tracker
    "megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__",  # 4.
    "megatron.core.tensor_parallel.mappings:_AllToAll.forward",  # 5.
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
    "megatron.core.tensor_parallel.mappings:_reduce_scatter_along_first_dim",
    "megatron.core.pipeline_parallel.p2p_communication:_p2p_ops",  # 6.
    "megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",
)


def resolve(target: str) -> tuple[Any, str]:
    """(owner, attribute name) of a `PATCH_TARGETS` entry: the module, or the class holding a
    method; raises ImportError/AttributeError when megatron-core has no such thing."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    names = path.split(".") if path else []
    for name in names[:-1]:
        owner = getattr(owner, name)
    if names:
        inspect.getattr_static(owner, names[-1])
    return owner, names[-1] if names else ""


def missing_targets(targets: tuple[str, ...]) -> list[str]:
    """The targets the installed megatron-core does not have (each with the error)."""
    out = []
    for t in targets:
        try:
            resolve(t)
        except (ImportError, AttributeError) as e:
            out.append(f"{t} ({type(e).__name__}: {e})")
    return out


def version_warning(version: str) -> str | None:
    """The warning for a megatron-core other than `WRITTEN_FOR`.x, else None."""
    if version == WRITTEN_FOR or version.startswith(WRITTEN_FOR + "."):
        return None
    return (
        f"megatron-core {version} is installed; the CPU shim (megatron_bridge/runtime/cpu.py) was "
        f"written for {WRITTEN_FOR}.x and its patch targets verified there. They all still exist, but "
        f"their behaviour may have changed: run tests/unit/runtime/test_cpu_shim.py and the CPU suite, or "
        f"install megatron-core=={WRITTEN_FOR}.*."
    )


def check_megatron(targets: tuple[str, ...] | None = None) -> None:
    """Refuse a megatron-core that lacks a target (before anything is patched); warn on
    another minor version than `WRITTEN_FOR`."""
    missing = missing_targets(PATCH_TARGETS if targets is None else targets)
    version = importlib.metadata.version("megatron-core")
    if missing:
        raise RuntimeError(
            f"megatron-core {version} lacks what the CPU shim patches (written for {WRITTEN_FOR}.x): "
            f"{'; '.join(missing)}. Install megatron-core=={WRITTEN_FOR}.* or update "
            "megatron_bridge/runtime/cpu_targets.py (PATCH_TARGETS) and cpu.py (install())."
        )
    message = version_warning(version)
    if message:
        warnings.warn(message, stacklevel=3)
