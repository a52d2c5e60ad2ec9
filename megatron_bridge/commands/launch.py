"""`mbr launch`: put a recipe on torchrun, the deepspeed launcher, Slurm or Kubernetes.

We generate the launchers' own command lines (torchrun's c10d rendezvous, a DeepSpeed
hostfile, an sbatch script running one torchrun agent per node under srun, a Kubeflow
PyTorchJob manifest: commands/k8s.py) instead of
managing processes ourselves. `--dry-run` prints them with the validated rank map; without
it, a single-node launch execs the local command. Multi-node launches must be started on
each node (or through Slurm / Kubernetes): we print exactly what to run where. Every rank
gets the recipe as an absolute path when it is a file and every user config dir as an
explicit `--config-dir`, so all ranks resolve the same files whatever their environment.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_bridge.backends.describe import describe
from megatron_bridge.commands import k8s, restart_ready
from megatron_bridge.config import search
from megatron_bridge.config.compose import Args, parse_command
from megatron_bridge.config.schema import TrainRunConfig
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.parallel.topology import Topology

ENTRY = ["-m", "megatron_bridge.train"]
LAUNCHERS = ("torchrun", "deepspeed", "slurm", "k8s")
# What --dry-run output=DIR writes, by the name the dry run prints it under.
OUTPUT_FILES = {"hostfile": "hostfile", "sbatch script": "job.sbatch", k8s.FILENAME: k8s.FILENAME}
# How to submit what was written (launchers that need a scheduler).
SUBMIT = {"slurm": "sbatch {out}/job.sbatch", "k8s": "kubectl apply -f {out}/" + k8s.FILENAME}


@dataclasses.dataclass
class LaunchConfig(TrainRunConfig):
    launcher: str = "torchrun"  # torchrun | deepspeed | slurm | k8s
    job_name: str = "mbr"
    output: str = ""  # where to write the hostfile / sbatch script / PyTorchJob (default: print only)
    # Times the launcher may bring a failed job back (torchrun --max-restarts, Slurm --requeue,
    # k8s OnFailure + backoffLimit); > 0 also writes checkpoint.resume=auto (restart_ready.py).
    max_restarts: int = 0
    k8s: k8s.K8sConfig = dataclasses.field(default_factory=k8s.K8sConfig)


def hosts(cfg) -> list[str]:
    """Node hostnames: cluster.hostnames, else cluster.hostfile, else master_addr for 1 node."""
    c = cfg.cluster
    if c.hostfile:
        p = Path(c.hostfile)
        if not p.is_file():
            raise UserError(
                f"cluster.hostfile={c.hostfile} does not exist. Create it (one `host slots=N` line per "
                "node) or list the nodes in cluster.hostnames=[a,b]."
            )
        names = [ln.split()[0] for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    else:
        names = list(c.hostnames) or ([c.master_addr] if c.nodes == 1 else [])
    if c.nodes > 1 and len(names) != c.nodes and cfg.launcher != "slurm":
        raise UserError(
            f"cluster.nodes={c.nodes} but {len(names)} host(s) are known ({names}). Set "
            "cluster.hostnames=[host1,host2,...] or cluster.hostfile=FILE with one line per node."
        )
    return names


def job_args(args: Args) -> list[str]:
    """The training job's arguments: the recipe (a file as its absolute path), the overrides
    minus launch-only fields, and every user config dir as an explicit `--config-dir`."""
    own = {f.name for f in dataclasses.fields(LaunchConfig)} - {f.name for f in dataclasses.fields(TrainRunConfig)}
    keep = [o for o in args.overrides if o.split("=", 1)[0].split(".", 1)[0] not in own]
    sources = args.sources()
    recipe = str(search.find_recipe(args.recipe, sources)) if search.is_recipe_path(args.recipe) else args.recipe
    return [f"recipe={recipe}", *keep, *search.launch_args(sources)]


def torchrun_commands(cfg, args: list[str]) -> dict[str, str]:
    c = cfg.cluster
    master = hosts(cfg)[0] if c.nodes > 1 else c.master_addr
    out = {}
    for node in range(c.nodes):
        cmd = [
            "torchrun",
            f"--nnodes={c.nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={c.gpus_per_node}",
            f"--rdzv-backend={c.rdzv_backend}",
            f"--rdzv-endpoint={master}:{c.master_port}",
            f"--rdzv-id={cfg.job_name}",
            *restart_ready.torchrun_flags(cfg),
            *ENTRY,
            *args,
        ]
        env = [f"{k}={v}" for k, v in restart_ready.env(cfg).items()]  # multi-node only: never exec'd
        out[f"node {node}" + (f" ({hosts(cfg)[node]})" if c.nodes > 1 else "")] = " ".join([*env, shlex.join(cmd)])
    return out


def deepspeed_files(cfg, args: list[str]) -> dict[str, str]:
    c = cfg.cluster
    names = hosts(cfg)
    hostfile = "".join(f"{h} slots={c.gpus_per_node}\n" for h in names)
    cmd = [
        "deepspeed",
        f"--num_nodes={c.nodes}",
        f"--num_gpus={c.gpus_per_node}",
        f"--master_addr={names[0]}",
        f"--master_port={c.master_port}",
    ]
    if c.nodes > 1:
        cmd.insert(1, f"--hostfile={c.hostfile or (cfg.output or '.') + '/hostfile'}")
    cmd += ["--module", "megatron_bridge.train", *args]
    return {"hostfile": hostfile, "command (on the first node)": shlex.join(cmd)}


def sbatch_script(cfg, args: list[str]) -> str:
    c = cfg.cluster
    backend = "gloo" if c.backend == "gloo" else "nccl"
    env = ["export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}"]
    if backend == "nccl":
        env += [
            "export NCCL_ASYNC_ERROR_HANDLING=1",
            "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
            "# export NCCL_SOCKET_IFNAME=ib0 NCCL_IB_HCA=mlx5   # set to your fabric",
        ]
    else:
        env += ["# export GLOO_SOCKET_IFNAME=eth0   # set to the interface the nodes share"]
    env += [f"export {k}={v}" for k, v in restart_ready.env(cfg).items()]
    inner = [
        "torchrun",
        "--nnodes=$SLURM_NNODES",
        "--node-rank=$SLURM_NODEID",
        f"--nproc-per-node={c.gpus_per_node}",
        f"--rdzv-backend={c.rdzv_backend}",
        "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT",
        "--rdzv-id=$SLURM_JOB_ID",
        *restart_ready.torchrun_flags(cfg),
        *ENTRY,
        *args,
    ]
    inner_s = " ".join(x if x.startswith("--") and "$" in x else shlex.quote(x) for x in inner)
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.job_name}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={c.gpus_per_node}" if backend == "nccl" else "# (CPU cluster: no GPUs requested)",
        f"#SBATCH --cpus-per-task={max(8, c.gpus_per_node * 8) if backend == 'nccl' else 8}",
        "#SBATCH --exclusive",
        *(["#SBATCH --requeue", "#SBATCH --open-mode=append"] if cfg.max_restarts else []),
        "set -euo pipefail",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export MASTER_PORT={c.master_port}",
        *env,
        f"srun --kill-on-bad-exit=1 bash -c '{inner_s}'",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    cfg, args = parse_command(argv, LaunchConfig, doc=__doc__)
    if cfg.launcher not in LAUNCHERS:
        raise UserError(f"launcher={cfg.launcher!r} is not one of {LAUNCHERS}.")
    model = describe(cfg.model)
    dims, notes = validate(cfg, model)
    jargs = job_args(args) + restart_ready.resume_args(cfg, args)
    dry = "--dry-run" in args.flags
    if cfg.launcher == "torchrun":
        files = torchrun_commands(cfg, jargs)
    elif cfg.launcher == "deepspeed":
        files = deepspeed_files(cfg, jargs)
    elif cfg.launcher == "k8s":
        files = {k8s.FILENAME: k8s.manifest_yaml(cfg, jargs)}
        if jargs[0] != f"recipe={args.recipe}" or len(search.launch_args(args.sources())):
            notes.append(
                "the pods read the recipe file and --config-dir dirs at the paths above: bake them into the image or put them on a mounted volume"
            )
    else:
        files = {"sbatch script": sbatch_script(cfg, jargs)}
    if cfg.launcher in SUBMIT and not dry:
        _check_submit(cfg)
    if dry or cfg.cluster.nodes > 1 or cfg.launcher in SUBMIT:
        print(f"layout OK: {dims.describe()}")
        for n in notes:
            print(f"note: {n}")
        spans = Topology(dims).span_summary(moe=model.is_moe)
        print("group placement: " + ", ".join(f"{k} {v}" for k, v in spans.items()))
        for name, text in files.items():
            print(f"--- {name} ---\n{text.rstrip()}")
        if cfg.output:
            _write_outputs(cfg, files)
        if cfg.launcher in SUBMIT:
            how = SUBMIT[cfg.launcher].format(out=cfg.output or "DIR")
            if not dry:  # _check_submit made sure the tool and output= are there
                print(f"submitting: {how}", flush=True)
                return subprocess.call(shlex.split(how))
            print(f"submit with: {how}" + ("" if cfg.output else "   (output=DIR writes the file)"))
        return 0
    # Single node, not a dry run: run the local part (exec the launcher).
    cmd = next(iter(files.values())) if cfg.launcher == "torchrun" else files.get("command (on the first node)")
    argv_exec = shlex.split(cmd)
    if shutil.which(argv_exec[0]) is None:  # not on PATH (venv not activated): same tool via python -m
        module = {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner"}[argv_exec[0]]
        argv_exec = [sys.executable, "-m", module, *argv_exec[1:]]
    os.execvp(argv_exec[0], argv_exec)
    return 0  # not reached


def _check_submit(cfg) -> None:
    """Submitting (no --dry-run) needs the scheduler's client and a file to hand it: refuse
    up front rather than print a script and exit 0 as if the job were launched."""
    tool = SUBMIT[cfg.launcher].split()[0]
    if shutil.which(tool) is None:
        raise UserError(
            f"launcher={cfg.launcher} needs `{tool}` on PATH to submit the job, and this machine has none. "
            f"Fix: use --dry-run with output=DIR to write the file, then "
            f"`{SUBMIT[cfg.launcher].format(out='DIR')}` where {tool} is available."
        )
    if not cfg.output:
        raise UserError(
            f"launcher={cfg.launcher} submits a file: add output=DIR (where the file is written before "
            f"`{tool}` reads it), or use --dry-run to print it."
        )


def _write_outputs(cfg, files: dict[str, str]) -> None:
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    for name, filename in OUTPUT_FILES.items():
        if name in files:
            (out / filename).write_text(files[name])
    print(f"wrote {out}")
