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
PROBE = "tests/dist/train_scripts/multinode_probe.py"


def two_nodes(args, timeout=600):
    port = free_port()
    with tempfile.TemporaryDirectory() as res:
        env = {**os.environ, RESULT_DIR_ENV: res, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}", "--nproc-per-node=2",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=mbr-test", PROBE, *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True) for n in (0, 1)]
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


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.pp=1"], ["parallel.tp=2", "parallel.pp=2"]],
                         ids=["tp2dp2", "tp2pp2"])
def test_two_node_job_matches_single_node(layout, tmp_path):
    hf = make_tiny("llama", tmp_path / "hf")
    common = ["recipe=tiny_llama", f"model.hf_path={hf}", "train.steps=3", "optimizer.warmup_steps=1", "train.seq_length=32",
              "train.global_batch_size=8", "train.micro_batch_size=1", *layout]
    multi = two_nodes([str(tmp_path / "multi"), *common, "cluster.nodes=2"])
    for r in multi:  # TP innermost: a TP group never leaves its torchrun agent ("node")
        assert {multi[m]["node"] for m in r["tp_group"]} == {r["node"]}, r
    assert {r["node"] for r in multi} == {0, 1}
    if layout[1] == "parallel.pp=2":  # PP spans the two nodes
        assert {multi[m]["node"] for m in multi[0]["pp_group"]} == {0, 1}
    single = run_torchrun([PROBE, str(tmp_path / "single"), *common], nproc=4, timeout=600,
                          env={"GROUP_RANK": "0"})
    assert single[0]["losses"] == pytest.approx(multi[0]["losses"], rel=1e-6)
