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


K8S_ARGS = (
    "recipe=llama3_8b",
    "launcher=k8s",
    "cluster=dgx_h100",
    "cluster.nodes=4",
    "parallel.tp=8",
    "k8s.image=ghcr.io/acme/mbr:0.1",
    "k8s.checkpoint_pvc=ckpt",
    "checkpoint.dir=/checkpoints/llama",
    "k8s.data_pvc=datasets",
    "job_name=llama-8b",
)


def test_k8s_pytorchjob_snapshot():
    r = mbr(*K8S_ARGS, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout == (SNAP / "k8s_4x8.txt").read_text()


def test_k8s_manifest_is_a_pytorchjob(tmp_path):
    """What the training operator reads: kind/apiVersion, one Master + nodes-1 Workers, a
    container named `pytorch` running torchrun on the operator's env, GPUs, /dev/shm, PVCs."""
    import yaml

    r = mbr(*K8S_ARGS, f"output={tmp_path}", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert f"kubectl apply -f {tmp_path}/pytorchjob.yaml" in r.stdout
    job = yaml.safe_load((tmp_path / "pytorchjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    assert job["metadata"]["name"] == "llama-8b" and job["spec"]["nprocPerNode"] == "8"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"}
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 3
    for spec in specs.values():
        pod = spec["template"]["spec"]
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == "ghcr.io/acme/mbr:0.1"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
        cmd = c["command"]
        assert cmd[0] == "torchrun"
        for flag, var in [
            ("--nnodes", "PET_NNODES"),
            ("--nproc-per-node", "PET_NPROC_PER_NODE"),
            ("--node-rank", "PET_NODE_RANK"),
            ("--master-addr", "MASTER_ADDR"),
            ("--master-port", "MASTER_PORT"),
        ]:
            assert f"{flag}=$({var})" in cmd
        job_args = cmd[cmd.index("megatron_bridge.train") + 1 :]
        assert job_args == [
            "recipe=llama3_8b",
            "cluster=dgx_h100",
            "cluster.nodes=4",
            "parallel.tp=8",
            "checkpoint.dir=/checkpoints/llama",
        ]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
        assert volumes["checkpoint"]["persistentVolumeClaim"]["claimName"] == "ckpt"
        assert volumes["data"]["persistentVolumeClaim"]["claimName"] == "datasets"
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts == {"dshm": "/dev/shm", "checkpoint": "/checkpoints", "data": "/data"}


def test_k8s_single_node_cpu_has_no_workers_and_no_gpus():
    import yaml

    r = mbr("recipe=tiny_llama", "launcher=k8s", "k8s.image=img", "--dry-run")
    assert r.returncode == 0, r.stderr
    job = yaml.safe_load(r.stdout.split("--- pytorchjob.yaml ---\n", 1)[1].split("submit with:")[0])
    assert set(job["spec"]["pytorchReplicaSpecs"]) == {"Master"}
    assert "resources" not in job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "launcher=k8s needs k8s.image="),
        (["k8s.image=i", "job_name=My_Job"], "job_name='My_Job' is not a valid Kubernetes name"),
        (
            ["k8s.image=i", "k8s.checkpoint_pvc=c", "checkpoint.dir=runs/x"],
            "is not under k8s.checkpoint_mount=/checkpoints",
        ),
        (["k8s.image=i", "k8s.restart_policy=Sometimes"], "k8s.restart_policy='Sometimes' is not one of"),
    ],
)
def test_k8s_refusals(args, needle, tmp_path):
    r = mbr("recipe=tiny_llama", "launcher=k8s", f"output={tmp_path}/out", *args, "--dry-run")
    assert r.returncode == 2 and needle in r.stderr, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


# -- restart-ready launches (in-process: a dry run execs nothing) ------------------------------
RESTART = ("recipe=tiny_llama", "max_restarts=3", "checkpoint.dir=/checkpoints/run", "checkpoint.save_interval=50")


def _dry(capsys, *args):
    from megatron_bridge.commands import launch

    assert launch.main([*args, "--dry-run"]) == 0
    return capsys.readouterr().out


def test_restart_ready_torchrun_two_nodes(capsys):
    out = _dry(capsys, *RESTART, "cluster.nodes=2", "cluster.gpus_per_node=2", "cluster.hostnames=[a,b]")
    lines = [ln for ln in out.splitlines() if "torchrun" in ln]
    assert len(lines) == 2
    for node, line in enumerate(lines):
        # a fresh rendezvous store per round (a replacement node restarts its count at 0)
        assert line.startswith("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2")
        assert f"--node-rank={node}" in line and "--rdzv-backend=c10d" in line and "--max-restarts=3" in line
        assert "checkpoint.dir=/checkpoints/run checkpoint.save_interval=50 " in line
        assert line.endswith(" checkpoint.resume=auto")
        assert "max_restarts" not in line  # a launch-only key is not handed to the ranks


def test_restart_ready_single_node_keeps_the_users_resume(capsys):
    out = _dry(capsys, *RESTART, "checkpoint.resume=true", "run_dir=/ck/logs")
    (line,) = [ln for ln in out.splitlines() if "torchrun" in ln]
    assert line.startswith("torchrun ") and "--max-restarts=3" in line  # one node: no env needed
    assert line.count("checkpoint.resume") == 1 and "checkpoint.resume=true" in line and "run_dir=/ck/logs" in line


def test_restart_ready_slurm_requeues(capsys):
    out = _dry(capsys, *RESTART, "launcher=slurm", "cluster.nodes=2", "cluster.gpus_per_node=2")
    assert "#SBATCH --requeue\n#SBATCH --open-mode=append\n" in out
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1\n" in out
    srun = next(ln for ln in out.splitlines() if ln.startswith("srun"))
    assert "--rdzv-id=$SLURM_JOB_ID --max-restarts=3 -m megatron_bridge.train" in srun
    assert srun.endswith("checkpoint.resume=auto'")
    plain = _dry(capsys, "recipe=tiny_llama", "launcher=slurm", "cluster.nodes=2", "cluster.gpus_per_node=2")
    assert "--requeue" not in plain and "--max-restarts" not in plain and "TORCH_DISABLE" not in plain


def test_restart_ready_k8s_restarts_pods(capsys):
    import yaml

    out = _dry(capsys, *RESTART, "launcher=k8s", "k8s.image=img", "cluster.nodes=2", "k8s.checkpoint_pvc=ck")
    job = yaml.safe_load(out.split("--- pytorchjob.yaml ---\n", 1)[1].split("submit with:")[0])
    assert job["spec"]["runPolicy"] == {"backoffLimit": 3}
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        assert spec["restartPolicy"] == "OnFailure"
        assert spec["template"]["spec"]["containers"][0]["command"][-1] == "checkpoint.resume=auto"
    # a policy given without max_restarts resumes too; no backoffLimit is invented
    out = _dry(capsys, *RESTART[:1], *RESTART[2:], "launcher=k8s", "k8s.image=img", "k8s.restart_policy=OnFailure")
    job = yaml.safe_load(out.split("--- pytorchjob.yaml ---\n", 1)[1].split("submit with:")[0])
    assert "runPolicy" not in job["spec"]
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"][-1] == (
        "checkpoint.resume=auto"
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["checkpoint.dir=/ck"], "checkpoint.save_interval=0 saves only at the end"),
        (["launcher=deepspeed", "checkpoint.dir=/ck"], "the deepspeed launcher does not restart"),
        (
            ["launcher=k8s", "k8s.image=i", "k8s.restart_policy=Never", "checkpoint.dir=/ck"],
            "k8s.restart_policy=Never: the pods would never be restarted",
        ),
        (["max_restarts=-1"], "max_restarts=-1: give how many times"),
    ],
)
def test_restart_ready_refusals(args, needle, capsys):
    from megatron_bridge.commands import launch
    from megatron_bridge.errors import UserError

    with pytest.raises(UserError, match=None) as e:
        launch.main(["recipe=tiny_llama", "max_restarts=2", *args, "--dry-run"])
    assert needle in str(e.value)
