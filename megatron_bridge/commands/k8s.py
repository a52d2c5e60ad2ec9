"""`mbr launch launcher=k8s`: a Kubeflow `PyTorchJob` manifest (training-operator, kubeflow.org/v1).

One pod per node: a `Master` replica and `cluster.nodes - 1` `Worker` replicas, each running
one torchrun agent with `cluster.gpus_per_node` processes. The operator creates the master
service and injects the rendezvous into every pod's environment (`PET_NNODES`,
`PET_NPROC_PER_NODE`, `PET_NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`); the container's
command refers to them as `$(VAR)`, which the kubelet expands, so the manifest holds no
addresses and needs no shell. We write the manifest; `kubectl apply -f` submits it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from megatron_bridge.commands import restart_ready
from megatron_bridge.errors import UserError

ENTRY = ["-m", "megatron_bridge.train"]
FILENAME = "pytorchjob.yaml"
RESTART_POLICIES = ("Never", "OnFailure", "ExitCode", "Always")


@dataclass
class K8sConfig:
    """The cluster-side facts a PyTorchJob needs that the recipe does not hold (`k8s.image=...`)."""

    image: str = ""  # container image with megatron_bridge and its dependencies installed (required)
    namespace: str = "default"
    # PersistentVolumeClaims mounted into every pod; checkpoint.dir / data.paths must lie under the mounts.
    checkpoint_pvc: str | None = None
    checkpoint_mount: str = "/checkpoints"
    data_pvc: str | None = None
    data_mount: str = "/data"
    # Never: a failed pod fails the job. OnFailure restarts it with the same command, which
    # `mbr launch` makes resume (checkpoint.resume=auto); max_restarts=N sets OnFailure and
    # runPolicy.backoffLimit=N.
    restart_policy: str = "Never"


# (pvc field, mount field, the recipe's paths that must lie under the mount, how to name them)
VOLUMES = (
    (
        "checkpoint_pvc",
        "checkpoint_mount",
        lambda cfg: [cfg.checkpoint.dir] if cfg.checkpoint.dir else [],
        "checkpoint.dir",
    ),
    (
        "data_pvc",
        "data_mount",
        lambda cfg: list(cfg.data.paths) + ([cfg.data.tokenizer] if cfg.data.tokenizer else []),
        "data.paths/data.tokenizer",
    ),
)


def _check(cfg: Any) -> None:
    k = cfg.k8s
    if not k.image:
        raise UserError(
            "launcher=k8s needs k8s.image=REGISTRY/IMAGE:TAG: an image with megatron_bridge installed "
            "(`pip install` of its wheel; docs/install.md), which every pod runs."
        )
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", cfg.job_name):
        raise UserError(
            f"job_name={cfg.job_name!r} is not a valid Kubernetes name (lower-case letters, digits and '-', "
            "starting and ending with a letter or digit, at most 63 characters). Fix: e.g. job_name=llama-8b."
        )
    if k.restart_policy not in RESTART_POLICIES:
        raise UserError(f"k8s.restart_policy={k.restart_policy!r} is not one of {', '.join(RESTART_POLICIES)}.")
    for pvc, mount, paths, what in VOLUMES:
        root = PurePosixPath(getattr(k, mount))
        outside = [p for p in paths(cfg) if root not in PurePosixPath(p).parents and PurePosixPath(p) != root]
        if getattr(k, pvc) and outside:
            raise UserError(
                f"{what} {outside} is not under k8s.{mount}={root}, where k8s.{pvc}={getattr(k, pvc)} is mounted, "
                f"so the pods would {'lose the checkpoints with the pod' if pvc == 'checkpoint_pvc' else 'not find it'}. "
                f"Fix: give paths under {root}, or set k8s.{mount} to where they are."
            )


def _pod(cfg: Any, args: list[str]) -> dict[str, Any]:
    c, k = cfg.cluster, cfg.k8s
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the training container by this name
        "image": k.image,
        "command": [
            "torchrun",
            "--nnodes=$(PET_NNODES)",
            "--nproc-per-node=$(PET_NPROC_PER_NODE)",
            "--node-rank=$(PET_NODE_RANK)",
            "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)",
            *ENTRY,
            *args,
        ],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if c.backend != "gloo":
        container["resources"] = {"limits": {"nvidia.com/gpu": c.gpus_per_node}}
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    for pvc, mount, _, _ in VOLUMES:
        if getattr(k, pvc):
            name = pvc.replace("_pvc", "")
            container["volumeMounts"].append({"name": name, "mountPath": getattr(k, mount)})
            volumes.append({"name": name, "persistentVolumeClaim": {"claimName": getattr(k, pvc)}})
    return {"spec": {"containers": [container], "volumes": volumes}}


def manifest(cfg: Any, args: list[str]) -> dict[str, Any]:
    """The PyTorchJob as a dict (validated first: image, name, volumes)."""
    _check(cfg)

    def replica(n: int) -> dict[str, Any]:  # a fresh dict each (shared ones would dump as YAML aliases)
        return {"replicas": n, "restartPolicy": restart_ready.k8s_policy(cfg), "template": _pod(cfg, args)}

    specs = {"Master": replica(1)}
    if cfg.cluster.nodes > 1:
        specs["Worker"] = replica(cfg.cluster.nodes - 1)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": cfg.job_name, "namespace": cfg.k8s.namespace},
        "spec": {
            "nprocPerNode": str(cfg.cluster.gpus_per_node),
            "pytorchReplicaSpecs": specs,
            **({"runPolicy": {"backoffLimit": cfg.max_restarts}} if cfg.max_restarts else {}),
        },
    }


def manifest_yaml(cfg: Any, args: list[str]) -> str:
    import yaml

    return yaml.safe_dump(manifest(cfg, args), sort_keys=False, default_flow_style=False, width=10_000)
