"""Run megatron-core 0.16 on CPU with gloo: a small set of targeted patches.

megatron-core assumes CUDA in a few dozen places. `install()` patches exactly those, only on a
host without CUDA (on a GPU it is a no-op, and the same code runs on NCCL untouched),
idempotently, before the first model/optimizer is built (`groups.initialize` calls it). The
attributes it patches are declared in `cpu_targets.PATCH_TARGETS` and all resolved before anything is
patched: a megatron-core that lacks one is refused with one message naming it (never left
half-patched), another minor version than `WRITTEN_FOR` gets a warning, and
tests/unit/runtime/test_cpu_shim.py asserts every target exists in the installed version. (The modules
holding them are imported with this one, which patches nothing by being imported; the replacement
tracker `CpuRNGStatesTracker` is an ordinary class, put in place by `install()` only.) What and why:

1. `torch` as megatron-core's modules see it: every `megatron.core.*` module's global `torch`
   becomes a proxy (all of torch, no lookup overhead) whose `cuda` maps `current_device()` to the
   CPU, `synchronize`/`empty_cache`/`nvtx` to no-ops, `Stream`/`Event`/`current_stream`/`stream`
   to inert stand-ins (DDP, MoE dispatchers, shared experts make side streams) and the CUDA RNG
   calls to the CPU generator (on CPU the "CUDA RNG" is the CPU generator), and whose tensor
   factories turn `device="cuda"`/a device index into the CPU and drop `pin_memory` (schedule
   token counts, optimizer found_inf, clip_grads, grad scaler, masks, data broadcast, rerun
   state machine, grad buffers, dist_checkpointing). Rebinding the module global, not
   `torch.cuda`, leaves torch/DeepSpeed/transformers alone; a global TorchFunctionMode doing the
   same intercepts every torch call of every library and slowed steps (docs/benchmarks.md).
   An import hook covers modules imported later.
2. RNG: `CudaRNGStatesTracker` -> `CpuRNGStatesTracker` (same tracker names, forks the CPU
   generator), `_get/_set_cuda_rng_state` -> CPU generator: `model_parallel_cuda_manual_seed`
   and activation recompute work (megatron asserts CUDA).
3. During the few functions that call them, `Tensor.cuda()` returns the tensor (tied embeddings
   with PP, broadcast_data, state loading, param-hash check) and `Tensor.type()` reports
   `torch.cuda.*Tensor`, so the optimizers'/clip_grads' `param.type() == 'torch.cuda.FloatTensor'`
   checks accept CPU parameters.
4. `WrappedTorchNorm` (local spec without Apex/TE) asserts `not sequence_parallel`; with SP it
   builds the same norm and marks its params `sequence_parallel`, so finalize_model_grads
   all-reduces their grads over the TP group.
5. MoE: variable split sizes arrive as tensors/numpy (made int lists); gloo has no uneven all_gather
   (pad to the max and trim).
6. Pipeline p2p: gloo's `batch_isend_irecv` matches two messages to the same peer by order, so
   at pp=2 (prev == next rank) interleaved 1F1B swaps them (wrong losses, exploding grads). Batched
   p2p is routed to megatron's non-batched `_p2p_ops`; still, set `batch_p2p_comm=False` on CPU.
Keep megatron's `*_fusion` flags off on CPU (their torch.compile kernels are untested here).

DeepSpeed, separately (`deepspeed_without_shm_op`, called before `deepspeed.initialize`): on a
CPU accelerator its TorchBackend JIT-compiles a shared-memory all-reduce op (C++ through ninja,
~30 s the first time on a host, then cached) that only its `inference_all_reduce` uses; it is
marked incompatible so it is never built (docs/benchmarks.md, "DeepSpeed's shared-memory comm op").
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import inspect
import sys
import types
from typing import Any

import torch
from megatron.core.pipeline_parallel import p2p_communication
from megatron.core.tensor_parallel import mappings
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer import torch_norm

from megatron_bridge.runtime.cpu_targets import CUDA_VIEW, check_megatron, resolve

_CPU = torch.device("cpu")
_INSTALLED = False
_MISSING = object()
_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "randperm",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "rand_like",
    "randn_like",
    "linspace",
    "eye",
    "empty_strided",
)


def _is_cuda(device) -> bool:
    if isinstance(device, (str, torch.device)):
        return torch.device(device).type == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a CUDA device index


def _cpu_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return factory


def _noop(*args, **kwargs):
    return None


class _Stream:
    """Stand-in for `torch.cuda.Stream` and `torch.cuda.Event`: CPU work is synchronous, so
    every wait returns at once and every event has completed."""

    def __init__(self, *args, **kwargs):
        pass

    record = wait = synchronize = wait_stream = wait_event = _noop
    query = lambda self: True  # noqa: E731
    elapsed_time = lambda self, other: 0.0  # noqa: E731
    record_event = lambda self, event=None: event or _Stream()  # noqa: E731


_DEFAULT_STREAM = _Stream()


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as megatron-core sees it on a CPU host; other attributes fall through."""

    current_device = staticmethod(lambda: _CPU)
    synchronize = staticmethod(_noop)
    empty_cache = staticmethod(_noop)
    Stream = ExternalStream = Event = _Stream
    current_stream = staticmethod(lambda device=None: _DEFAULT_STREAM)
    default_stream = staticmethod(lambda device=None: _DEFAULT_STREAM)
    stream = staticmethod(lambda stream=None: contextlib.nullcontext())
    set_stream = staticmethod(_noop)
    get_rng_state = staticmethod(lambda device="cuda": torch.get_rng_state())
    set_rng_state = staticmethod(lambda state, device="cuda": torch.set_rng_state(state))
    manual_seed = staticmethod(lambda seed: torch.manual_seed(seed))
    manual_seed_all = staticmethod(lambda seed: torch.manual_seed(seed))
    memory_allocated = max_memory_allocated = memory_reserved = staticmethod(lambda *a, **k: 0)
    memory_stats = staticmethod(lambda *a, **k: {})
    nvtx = types.SimpleNamespace(range_push=_noop, range_pop=_noop, range=lambda *a, **k: contextlib.nullcontext())

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu(types.ModuleType):
    """The `torch` global of megatron-core modules: real torch except `cuda` and factories."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__.update(vars(torch))
        self.cuda = _CudaOnCpu("torch.cuda")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):  # attributes torch creates lazily after the snapshot
        return getattr(torch, name)


_TORCH = None


def _redirect(module) -> None:
    if getattr(module, "torch", None) is torch:
        module.torch = _TORCH


class _RedirectFinder(importlib.abc.MetaPathFinder):
    """Gives megatron.core modules imported after `install()` the CPU `torch` too."""

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron.core"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is not None and hasattr(loader, "exec_module"):
            exec_module = loader.exec_module

            def exec_and_redirect(module):
                exec_module(module)
                _redirect(module)

            loader.exec_module = exec_and_redirect  # type: ignore[method-assign]  # the import hook's point
        return spec


def _replace_everywhere(old, new) -> None:
    """Rebind a module-level function in every megatron module that imported it."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron") and hasattr(mod, "__dict__"):
            for key, val in list(vars(mod).items()):
                if val is old:
                    setattr(mod, key, new)


def _wrap_method(owner, name, make) -> None:
    raw = inspect.getattr_static(owner, name)
    if isinstance(raw, (classmethod, staticmethod)):
        setattr(owner, name, type(raw)(make(raw.__func__)))
    else:
        setattr(owner, name, make(raw))


def _cuda_type(self, dtype=None, non_blocking=False, **kwargs):
    name = torch._C.TensorBase.type(self, dtype, non_blocking, **kwargs)
    if dtype is None and isinstance(name, str) and self.device.type == "cpu":
        return name.replace("torch.", "torch.cuda.", 1)
    return name


@contextlib.contextmanager
def _tensors_look_cuda():
    saved = {k: torch.Tensor.__dict__.get(k, _MISSING) for k in ("cuda", "type")}
    torch.Tensor.cuda, torch.Tensor.type = (lambda self, *a, **k: self), _cuda_type  # type: ignore[method-assign]  # restored below
    try:
        yield
    finally:
        for key, val in saved.items():
            if val is _MISSING:
                delattr(torch.Tensor, key)
            else:
                setattr(torch.Tensor, key, val)


def _in_cuda_view(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensors_look_cuda():
            return fn(*args, **kwargs)

    return wrapper


def _int_list(sizes):
    if sizes is None or isinstance(sizes, list) and all(type(s) is int for s in sizes):
        return sizes
    return [int(s) for s in (sizes.tolist() if hasattr(sizes, "tolist") else sizes)]


# megatron's tracker, resolved without failing here: a megatron-core that lacks it is refused
# by install()'s `check_megatron()` with one message naming every missing target.
_TRACKER_BASE: Any = getattr(megatron_random, "CudaRNGStatesTracker", object)


class CpuRNGStatesTracker(_TRACKER_BASE):
    """`CudaRNGStatesTracker` for CPU: named CPU-generator states, forked around regions
    (data-parallel-rng, model-parallel-rng, expert-parallel-rng). Subclasses megatron's
    tracker so its isinstance checks still hold; megatron uses it only once `install()` has
    put it in place of its own (on a host without CUDA)."""

    _current_state_name: str  # set by megatron's reset()

    def __init__(self, use_cudagraphable_rng=False, is_inference_rng_tracker=False):
        self.reset()
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig_state, orig_name = torch.get_rng_state(), self._current_state_name
        if orig_name != "default-rng":
            self.states_[orig_name] = orig_state
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if orig_name != "default-rng":
                orig_state = self.states_[orig_name]
            torch.set_rng_state(orig_state)
            self._current_state_name = orig_name


def deepspeed_without_shm_op() -> None:
    """On a host without CUDA: DeepSpeed skips its shared-memory comm op (module docstring)."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops  # the caller is about to initialise DeepSpeed: imported already

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def is_installed() -> bool:
    """True once `install()` has patched megatron-core (CPU hosts only)."""
    return _INSTALLED


class _WithoutSP:
    """A TransformerConfig seen without sequence parallelism (the torch norms' constructor
    must not take the SP path on CPU; their parameters are marked for SP by hand)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return False if name == "sequence_parallel" else getattr(self._config, name)


def install() -> bool:
    """Patch megatron-core for CPU/gloo. Returns True when the shim is active, False on a
    CUDA host (nothing is patched there). Safe to call any number of times."""
    global _INSTALLED, _TORCH
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    check_megatron()  # resolves every target patched below; nothing is patched yet if it raises

    # 1. torch.cuda / device="cuda" as seen by megatron.core
    _TORCH = _TorchOnCpu()
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron.core"):
            _redirect(mod)
    sys.meta_path.insert(0, _RedirectFinder())

    # 2. RNG
    megatron_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    _replace_everywhere(megatron_random._get_cuda_rng_state, lambda *a, **k: torch.get_rng_state())
    _replace_everywhere(megatron_random._set_cuda_rng_state, lambda s, *a, **k: torch.set_rng_state(s))
    megatron_random.initialize_rng_tracker(force_reset=True)

    # 3. Tensor.cuda() / Tensor.type() inside the functions that use them
    for target in CUDA_VIEW:
        owner, name = resolve(target)
        if inspect.isclass(owner):
            _wrap_method(owner, name, _in_cuda_view)
        else:
            fn = getattr(owner, name)
            _replace_everywhere(fn, _in_cuda_view(fn))

    # 4. torch norms with sequence parallelism
    norm_new = torch_norm.WrappedTorchNorm.__new__

    def wrapped_norm_new(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return norm_new(cls, config, *args, **kwargs)
        norm = norm_new(cls, _WithoutSP(config), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(wrapped_norm_new)

    # 5. MoE
    all_to_all_forward = mappings._AllToAll.forward

    def all_to_all_forward_int(ctx, group, input, output_split_sizes, input_split_sizes):
        return all_to_all_forward(ctx, group, input, _int_list(output_split_sizes), _int_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(all_to_all_forward_int)
    gather_first, reduce_scatter_first = (
        mappings._gather_along_first_dim,
        mappings._reduce_scatter_along_first_dim,
    )

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = _int_list(output_split_sizes)
        if sizes is None or group.size() == 1:
            return gather_first(input_, group, sizes, use_global_buffer)
        padded = input_.new_zeros((max(sizes),) + tuple(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        return reduce_scatter_first(input_, group, _int_list(input_split_sizes), use_global_buffer)

    _replace_everywhere(gather_first, gather_along_first_dim)
    _replace_everywhere(reduce_scatter_first, reduce_scatter_along_first_dim)

    # 6. pipeline p2p on gloo: never batch_isend_irecv
    p2p_ops = p2p_communication._p2p_ops
    _replace_everywhere(p2p_communication._batched_p2p_ops, lambda **kw: list(p2p_ops(**kw).values()))

    _INSTALLED = True
    return True


def model_parallel_manual_seed(seed: int) -> None:
    """`model_parallel_cuda_manual_seed` for either device: megatron's own on GPU; on CPU the
    same seed offsets (data-parallel = seed, model-parallel = seed + 2718 + tp_rank,
    expert-parallel = seed + 1024 + 100·ep_rank + etp_rank) on a fresh `CpuRNGStatesTracker`.
    Call after `initialize_model_parallel`."""
    install()
    torch.manual_seed(seed)
    megatron_random.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
