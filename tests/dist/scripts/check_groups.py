"""Under torchrun: build megatron-core's groups for several layouts in one launch and report,
per layout, the ranks of every group this rank belongs to (megatron's view and the DeepSpeed
mpu's view) plus an all-reduce over each group, so the test can compare them with `Topology`.

    torchrun --nproc-per-node 8 tests/dist/scripts/check_groups.py \
        "recipe=tiny_llama parallel.tp=2 parallel.pp=2" "recipe=tiny_mixtral parallel.pp=2"
"""

import sys

import torch

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.forking import thread_names
from megatron_bridge.runtime import cpu, groups
from megatron_bridge.testing import report


def megatron_groups(ps):
    return {
        "tp": ps.get_tensor_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tp_cp": ps.get_tensor_and_context_parallel_group(),
        "mp": ps.get_model_parallel_group(),
        "ep": ps.get_expert_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "edp": ps.get_expert_data_parallel_group(),
    }


def mpu_view(mpu):
    """What DeepSpeed sees through the mpu: (group, rank, world size) per kind."""
    return {
        "mp": (mpu.get_model_parallel_group(), mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
        "tp": (
            mpu.get_tensor_model_parallel_group(),
            mpu.get_tensor_model_parallel_rank(),
            mpu.get_tensor_model_parallel_world_size(),
        ),
        "pp": (
            mpu.get_pipeline_model_parallel_group(),
            mpu.get_pipeline_model_parallel_rank(),
            mpu.get_pipeline_model_parallel_world_size(),
        ),
        "dp": (mpu.get_data_parallel_group(), mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
        "cp": (
            mpu.get_sequence_parallel_group(),
            mpu.get_sequence_parallel_rank(),
            mpu.get_sequence_parallel_world_size(),
        ),
        "dp_cp": (
            mpu.get_sequence_data_parallel_group(),
            mpu.get_sequence_data_parallel_rank(),
            mpu.get_sequence_data_parallel_world_size(),
        ),
        "ep": (
            mpu.get_expert_model_parallel_group(),
            mpu.get_expert_model_parallel_rank(),
            mpu.get_expert_model_parallel_world_size(),
        ),
    }


def deepspeed_view(mpu):
    """The groups as DeepSpeed's engine obtains them: through its own accessors over the mpu."""
    import deepspeed
    from deepspeed.utils import bwc
    from deepspeed.utils import groups as ds_groups

    from megatron_bridge.runtime.cpu import deepspeed_without_shm_op

    deepspeed_without_shm_op()  # as the DeepSpeed engine does (no JIT build of an unused comm op)
    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend())  # adopts our group
    ranks = torch.distributed.get_process_group_ranks
    ds_groups.mpu = mpu  # what DeepSpeedEngine.__init__ does with the mpu it is given
    try:
        return {
            "dp": ranks(ds_groups._get_data_parallel_group()),
            "dp_size": ds_groups._get_data_parallel_world_size(),
            "dp_rank": ds_groups._get_data_parallel_rank(),
            "dp_ranks": list(ds_groups._get_data_parallel_group_ranks()),
            "mp_size": ds_groups._get_model_parallel_world_size(),
            "sp_size": ds_groups._get_sequence_parallel_world_size(),
            "sdp": ranks(ds_groups._get_sequence_data_parallel_group()),
            "broadcast_src": ds_groups._get_broadcast_src_rank(),
            "tp": ranks(bwc.bwc_tensor_model_parallel_group(mpu)),
            "tp_rank": bwc.bwc_tensor_model_parallel_rank(mpu),
            "tp_size": bwc.bwc_tensor_model_parallel_world_size(mpu),
            "pp": ranks(bwc.bwc_pipeline_parallel_group(mpu)),
            "pp_size": bwc.bwc_pipeline_parallel_world_size(mpu),
        }
    finally:
        ds_groups.mpu = None


def rng_draws():
    """Draws from each RNG stream right after `initialize` seeded them: the default
    (data-parallel) stream and forks of the model-parallel and expert-parallel trackers."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, random

    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        model = torch.rand(3).tolist()
    with tracker.fork(random.get_expert_parallel_rng_tracker_name()):
        expert = torch.rand(3).tolist()
    default = torch.rand(3).tolist()  # forks above must not have consumed the default stream
    return {"tracker": type(tracker).__name__, "model": model, "expert": expert, "default": default}


def gloo_loop_threads() -> int:
    """This process's gloo transport threads (one per live gloo process group; each wakes every 10 ms)."""
    return (thread_names() or []).count("gloo_tcp_loop")


def main(layouts):
    from megatron.core import parallel_state as ps

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    out = {}
    for overrides in layouts:
        cfg, _ = compose(overrides.split())
        dims = groups.dims_from_env(cfg, describe(cfg.model))
        mpu = groups.initialize(dims, seed=cfg.train.seed)
        rank = torch.distributed.get_rank()
        entry = {
            "dims": {k: getattr(dims, k) for k in ("tp", "pp", "cp", "ep", "etp", "dp", "world_size")},
            "megatron": {},
            "allreduce": {},
            "mpu": {},
            "deepspeed": {},
        }
        for name, group in megatron_groups(ps).items():
            entry["megatron"][name] = torch.distributed.get_process_group_ranks(group)
            t = torch.tensor([float(rank)])
            torch.distributed.all_reduce(t, group=group)  # the group really communicates
            entry["allreduce"][name] = t.item()
        for name, (group, grank, gsize) in mpu_view(mpu).items():
            entry["mpu"][name] = {
                "ranks": torch.distributed.get_process_group_ranks(group),
                "rank": grank,
                "size": gsize,
            }
        entry["mpu"]["dp_group_ranks"] = list(mpu.get_data_parallel_group_ranks())
        entry["deepspeed"] = deepspeed_view(mpu)
        entry["rng"] = rng_draws()
        entry["groups_made"] = len(groups.process_groups()) - 1
        del group  # the loops' last one: a referenced group (and its thread) outlives its destruction
        groups.release()  # the next layout's initialize would too; here so the test sees what is left
        entry["groups_left"] = len(groups.process_groups()) - 1
        entry["gloo_loops_left"] = gloo_loop_threads()
        out[overrides] = entry
    report({"rank": rank, "layouts": out, "shim": cpu.is_installed()})
    groups.destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
