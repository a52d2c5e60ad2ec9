"""A real two-"node" job on one machine: two torchrun agents (--nnodes 2, c10d rendezvous),
each with 2 processes, as `mbr launch` prints them. TP groups must stay inside a node and
the losses must equal the single-node run of the same layout."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import RESULT_DIR_ENV, free_port, run_torchrun

pytestmark = pytest.mark.dist
LAUNCHER = "torchrun"  # the test is about torchrun's agents and rendezvous (its reference run: fork)
PROBE = "tests/dist/train_scripts/multinode_probe.py"


def two_nodes(args, timeout=600):
    port = free_port()
    with tempfile.TemporaryDirectory() as res:
        env = {**os.environ, RESULT_DIR_ENV: res, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    f"--node-rank={n}",
                    "--nproc-per-node=2",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=mbr-test",
                    PROBE,
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            for n in (0, 1)
        ]
        deadline, outs = time.monotonic() + timeout, []
        try:
            for p in procs:
                outs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0].decode(errors="replace"))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
        assert all(p.returncode == 0 for p in procs), "\n".join(o[-4000:] for o in outs)
        return [json.loads((Path(res) / f"rank{r}.json").read_text()) for r in range(4)]


def test_two_node_jobs_match_single_node(tmp_path):
    """tp2·dp2 (DP across the nodes) and tp2·pp2 (PP across them) as two-node jobs, one after the
    other in one two-node launch, against one single-node run (2 launches: CI time): tp2·pp2
    equals its single-node run to 1e-6, tp2·dp2 the same run to the 2e-5 that separates layouts
    (tests/dist/test_train.py)."""
    hf = make_tiny("llama", tmp_path / "hf")
    common = [
        "recipe=tiny_llama",
        f"model.hf_path={hf}",
        "train.steps=3",
        "optimizer.warmup_steps=1",
        "train.seq_length=32",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
        "parallel.tp=2",
    ]
    jobs = {f"pp{pp}": ",".join([*common, f"parallel.pp={pp}", "cluster.nodes=2"]) for pp in (1, 2)}
    ranks = two_nodes([str(tmp_path / "multi"), *(f"{name}:{ov}" for name, ov in jobs.items())])
    multi = {pp: [r[f"pp{pp}"] for r in ranks] for pp in (1, 2)}
    for per_rank in multi.values():
        for r in per_rank:  # TP innermost: a TP group never leaves its torchrun agent ("node")
            assert {per_rank[m]["node"] for m in r["tp_group"]} == {r["node"]}, r
        assert {r["node"] for r in per_rank} == {0, 1}
    assert {multi[2][m]["node"] for m in multi[2][0]["pp_group"]} == {0, 1}  # PP spans the two nodes
    single = run_torchrun([PROBE, str(tmp_path / "single"), "pp2:" + ",".join([*common, "parallel.pp=2"])], nproc=4,
                          timeout=600, env={"GROUP_RANK": "0"}, launcher="fork")[0]["pp2"]  # fmt: skip
    assert single["losses"] == pytest.approx(multi[2][0]["losses"], rel=1e-6)
    assert single["losses"] == pytest.approx(multi[1][0]["losses"], rel=2e-5)
