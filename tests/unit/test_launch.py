"""`mbr launch --dry-run`: exact launcher commands (snapshots) and launch-time refusals."""

import subprocess
import sys
from pathlib import Path

import pytest

SNAP = Path(__file__).parent / "snapshots"


def mbr(*args):
    return subprocess.run(
        [sys.executable, "-m", "megatron_bridge.cli", "launch", *args], capture_output=True, text=True, timeout=120
    )


def test_slurm_4_nodes_x_8_gpus_snapshot():
    r = mbr(
        "recipe=gpt3_175b",
        "launcher=slurm",
        "cluster.nodes=4",
        "parallel.pp=4",
        "train.global_batch_size=64",
        "job_name=gpt",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == (SNAP / "slurm_4x8.txt").read_text()
    assert "#SBATCH --nodes=4" in r.stdout and "#SBATCH --gpus-per-node=8" in r.stdout


def test_deepspeed_hostfile_snapshot(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("node-a slots=8\nnode-b slots=8\n")
    r = mbr(
        "recipe=llama3_8b",
        "launcher=deepspeed",
        "cluster.nodes=2",
        "parallel.tp=8",
        f"cluster.hostfile={hf}",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.replace(str(hf), "HOSTFILE") == (SNAP / "deepspeed_2x8.txt").read_text()


def test_write_sbatch_and_hostfile(tmp_path):
    r = mbr(
        "recipe=tiny_llama",
        "launcher=slurm",
        "cluster.nodes=2",
        "cluster.gpus_per_node=2",
        f"output={tmp_path}",
        "--dry-run",
    )
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "job.sbatch").read_text()
    assert text.startswith("#!/bin/bash") and "--nproc-per-node=2" in text


@pytest.mark.parametrize(
    "args,needle",
    [
        (["recipe=llama3_8b", "cluster.nodes=2", "parallel.dp=4"], "[world-size]"),
        (["recipe=llama3_70b", "cluster.gpus_per_node=4", "cluster.nodes=16"], "[tp-in-node]"),
        (
            [
                "recipe=tiny_llama",
                "launcher=deepspeed",
                "cluster.nodes=2",
                "cluster.gpus_per_node=2",
                "cluster.hostfile=/nonexistent/hosts",
            ],
            "cluster.hostfile=/nonexistent/hosts does not exist",
        ),
        (["recipe=tiny_llama", "cluster.nodes=2", "cluster.gpus_per_node=2"], "0 host(s) are known"),
        (["recipe=tiny_llama", "launcher=mpirun"], "launcher='mpirun' is not one of"),
    ],
)
def test_launch_refusals(args, needle):
    r = mbr(*args, "--dry-run")
    assert r.returncode == 2 and needle in r.stderr, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
