"""Create the process groups of a layout, once, for megatron-core and DeepSpeed alike.

`initialize(dims)` is the only place that talks to `torch.distributed` and megatron-core's
`parallel_state`: it checks the launcher's world size against the layout, starts the default
process group (NCCL on GPU, gloo on CPU, `env://` rendezvous), installs the CPU shim when there
is no GPU, builds megatron's groups in the order "tp-cp-ep-dp-pp" (the same grid as
`Topology`), seeds the RNG trackers, and returns a DeepSpeed `mpu` that answers DeepSpeed's
questions from those same groups — so the two engines can never disagree on who is whose peer.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
from megatron.core import parallel_state

from megatron_bridge.errors import UserError
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import validate as validate_layout
from megatron_bridge.runtime import cpu, megatron_fixes

ORDER = "tp-cp-ep-dp-pp"
PP_SEED_STRIDE = 10007  # > megatron's largest per-rank seed offset (1024 + 100·ep + etp, 2718 + tp)


def launcher_world_size() -> int | None:
    """WORLD_SIZE set by torchrun / the deepspeed launcher, or None outside a launcher."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None


def dims_from_env(cfg, spec, *, validate: bool = True) -> ParallelDims:
    """ParallelDims for a composed `Config` whose model `spec` describes, with the launcher's
    real world size (1 outside a launcher). With `validate`, every rule is checked
    (`LayoutError` lists them all)."""
    world = launcher_world_size() or 1
    if validate:
        return validate_layout(cfg, spec, world)[0]
    return ParallelDims.from_config(cfg, world, moe=spec.is_moe)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_world(dims: ParallelDims) -> int:
    world = launcher_world_size()
    if world is None:
        if dims.world_size != 1:
            raise UserError(
                f"the layout {dims.describe()} needs {dims.world_size} processes, but no launcher "
                "set WORLD_SIZE. Start it with `torchrun --nproc-per-node "
                f"{dims.world_size} ...` (or the deepspeed launcher)."
            )
        # A single process without a launcher: provide the env:// rendezvous ourselves.
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        world = 1
    if world != dims.world_size:
        raise UserError(
            f"the launcher started {world} processes (WORLD_SIZE={world}) but the layout "
            f"{dims.describe()} was resolved for world_size={dims.world_size}. Build the layout "
            "with the real world size (`dims_from_env(cfg)`) or start "
            f"{dims.world_size} processes."
        )
    if dims.tp * dims.pp * dims.cp * dims.dp != world:
        raise UserError(
            f"tp·pp·cp·dp = {dims.tp}·{dims.pp}·{dims.cp}·{dims.dp} = "
            f"{dims.tp * dims.pp * dims.cp * dims.dp} does not match the {world} processes. "
            "Set parallel.dp=-1 to infer dp from the world size."
        )
    return world


def _rendezvous(timeout: timedelta) -> dict:
    """`init_process_group`'s rendezvous: `env://`, except under a torchrun agent that hosts the
    store (`TORCHELASTIC_USE_AGENT_STORE`). That store outlives a restart, and the default
    group's keys (gloo's addresses, NCCL's unique id) do not depend on the attempt: a restarted
    rank would read its dead predecessor's and connect to nothing. Each attempt gets its own
    key prefix (`TORCHELASTIC_RESTART_COUNT`: every agent of a static rendezvous restarts with
    its workers; `mbr launch` gives multi-node c10d rendezvous a fresh store per round)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": "env://"}
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": torch.distributed.PrefixStore(f"mbr/attempt_{attempt}", store)}


def initialize(
    dims: ParallelDims,
    *,
    backend: str | None = None,
    timeout_minutes: float = 10,
    seed: int = 1234,
    create_gloo_groups: bool = True,
) -> MegatronMPU:
    """Start torch.distributed (if needed) and megatron-core's model-parallel groups for `dims`.

    backend: "nccl" on a GPU host, "gloo" otherwise, unless given. timeout_minutes bounds every
    collective, so a dead rank ends the job. seed seeds python/numpy/torch and megatron's RNG
    trackers with seed + 10007·pp_rank, so pipeline stages draw different streams. (Megatron-LM
    adds 100·pp_rank, which makes stage p's expert-parallel seed for ep rank e+1 equal stage
    p+1's for ep rank e: experts of different layers would share init/dropout streams.)
    create_gloo_groups: megatron's gloo copies of the DP groups (its default; the distributed
    optimizer's checkpointing and `get_megatron_optimizer(use_gloo_process_groups=True)` need
    them). Calling it again with another layout replaces the model-parallel groups (the default
    process group is kept). Returns the DeepSpeed `mpu` (`MegatronMPU`)."""
    world = _check_world(dims)  # before any process group: a wrong launch fails at once
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise UserError("backend 'nccl' needs CUDA GPUs; none is visible. Use cluster.backend=gloo.")
    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise UserError(
                f"torch.distributed is already initialized with {dist.get_world_size()} "
                f"processes, but the layout needs {world}."
            )
    else:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend=backend,
            world_size=world,
            rank=int(os.environ["RANK"]),
            timeout=timedelta(minutes=timeout_minutes),
            **_rendezvous(timedelta(minutes=timeout_minutes)),
        )
    megatron_fixes.apply()
    if not cuda:
        cpu.install()
    release()
    before = set(process_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp and dims.vpp > 1 else None,
        context_parallel_size=dims.cp,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        distributed_timeout_minutes=int(max(1, round(timeout_minutes))),
        order=ORDER,
        create_gloo_process_groups=create_gloo_groups,
    )
    _MEGATRON_GROUPS[:] = [pg for pg in process_groups() if pg not in before]
    stage_seed = seed + PP_SEED_STRIDE * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    cpu.model_parallel_manual_seed(stage_seed)
    return MegatronMPU()


def comm_device() -> torch.device:
    """Where a tensor for a collective must live: the current GPU when the default group is
    NCCL (it takes no CPU tensors), the CPU under gloo."""
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def release() -> None:
    """Take megatron's groups down and destroy the process groups `initialize` made for them;
    the default group stays (the next layout of a launch, `job.run(finalize=False)`).

    Collective: every rank calls it after its last collective on those groups. megatron's own
    `destroy_model_parallel` destroys its gloo copies and only forgets the rest, and a forgotten
    gloo group lives on with its transport thread waking every 10 ms (gloo's tcp loop) and two
    worker threads: ~17 groups a layout, so a launch that ran a few dozen layouts spent a fifth
    of its CPU in those wake-ups (docs/contributing.md, "Test time")."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    made = list(_MEGATRON_GROUPS)
    _MEGATRON_GROUPS.clear()
    alive = set(process_groups())
    doomed = [pg for pg in made if pg in alive]  # destroy_model_parallel destroys its gloo copies itself
    if doomed:
        torch.distributed.barrier()  # no peer is still inside a collective on them
        for pg in doomed:
            torch.distributed.destroy_process_group(pg)
    megatron_fixes.forget_groups(made)


def destroy() -> None:
    """Drop megatron's groups and the default process group (tests, layout switches)."""
    release()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# The process groups the last `initialize` made for megatron-core (release() destroys them).
_MEGATRON_GROUPS: list = []


def process_groups() -> list:
    """Every process group this rank is a member of, the default one included."""
    if not torch.distributed.is_initialized():
        return []
    return list(torch.distributed.distributed_c10d._world.pg_map)


def _ranks(group) -> list[int]:
    return torch.distributed.get_process_group_ranks(group)


class MegatronMPU:
    """DeepSpeed's `mpu` protocol answered by megatron-core's `parallel_state`.

    DeepSpeed 0.19 calls: get_{model,data,tensor_model,pipeline_model}_parallel_{rank,world_size,
    group}, get_data_parallel_group_ranks, get_tensor_model_parallel_src_rank, the
    get_pipe_parallel_* / get_slice_parallel_* aliases, and the sequence(-data) parallel
    getters. "Model parallel" is megatron's tp×pp group (DeepSpeed all-reduces grad norms over
    it). "Data parallel" is pure dp: DeepSpeed sizes the batch by it. DeepSpeed's "sequence
    parallel" (Ulysses) slot is megatron's context parallelism: gradients must be reduced over
    dp×cp, which DeepSpeed does through the sequence-data-parallel group when cp > 1.
    `initialize_sequence_parallel` is deliberately absent: DeepSpeed would then treat this as
    its own Ulysses mpu and ignore the model-parallel groups.
    """

    ps = parallel_state

    # model parallel (tp × pp)
    def get_model_parallel_group(self):
        return self.ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return torch.distributed.get_world_size(self.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        return torch.distributed.get_rank(self.get_model_parallel_group())

    # tensor parallel (DeepSpeed's "slice" parallel)
    def get_tensor_model_parallel_group(self):
        return self.ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.ps.get_tensor_model_parallel_src_rank()

    get_slice_parallel_group = get_tensor_model_parallel_group
    get_slice_parallel_world_size = get_tensor_model_parallel_world_size
    get_slice_parallel_rank = get_tensor_model_parallel_rank

    # pipeline parallel
    def get_pipeline_model_parallel_group(self):
        return self.ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.ps.get_pipeline_model_parallel_rank()

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank

    # data parallel (pure dp, without cp)
    def get_data_parallel_group(self):
        return self.ps.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self.ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self.ps.get_data_parallel_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return _ranks(self.get_data_parallel_group())

    # context parallel, in DeepSpeed's sequence-parallel slots
    def get_sequence_parallel_group(self):
        return self.ps.get_context_parallel_group()

    def get_sequence_parallel_world_size(self) -> int:
        return self.ps.get_context_parallel_world_size()

    def get_sequence_parallel_rank(self) -> int:
        return self.ps.get_context_parallel_rank()

    def get_sequence_data_parallel_group(self):
        return self.ps.get_data_parallel_group(with_context_parallel=True)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.ps.get_data_parallel_world_size(with_context_parallel=True)

    def get_sequence_data_parallel_rank(self) -> int:
        return self.ps.get_data_parallel_rank(with_context_parallel=True)

    # experts (not called by DeepSpeed's engine; for our own MoE wiring and checks)
    def get_expert_model_parallel_group(self):
        return self.ps.get_expert_model_parallel_group()

    def get_expert_model_parallel_world_size(self) -> int:
        return self.ps.get_expert_model_parallel_world_size()

    def get_expert_model_parallel_rank(self) -> int:
        return self.ps.get_expert_model_parallel_rank()

    def get_expert_tensor_parallel_group(self):
        return self.ps.get_expert_tensor_parallel_group()

    def get_expert_data_parallel_group(self):
        return self.ps.get_expert_data_parallel_group()

    def get_expert_data_parallel_world_size(self) -> int:
        return self.ps.get_expert_data_parallel_world_size()


__all__ = [
    "initialize",
    "destroy",
    "comm_device",
    "dims_from_env",
    "launcher_world_size",
    "MegatronMPU",
    "ORDER",
    "PP_SEED_STRIDE",
]
