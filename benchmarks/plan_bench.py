"""Time `mbr plan`'s full search: Llama 3 405B on 16,384 H100 (2,048 DGX nodes), target < 2 s.

    .venv/bin/python benchmarks/plan_bench.py [--repeat 5] [--cli 3]

Prints, per case, the time of compose (Hydra), search (every tp/cp/pp/vpp/ep/etp/zero/
recompute/micro-batch candidate through the layout rules and the memory model) and report
(including the 16,384-rank Topology of the chosen layout), as the minimum and median of
`--repeat` in-process runs, then the wall time of the whole `mbr plan` command (Python
start-up and imports included) over `--cli` runs. No torch is imported.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose  # noqa: E402
from megatron_bridge.plan import report  # noqa: E402
from megatron_bridge.plan.evaluation import Context  # noqa: E402
from megatron_bridge.plan.search import pinned_from_overrides, search  # noqa: E402

CASES = {
    "llama3_405b @ 16,384 H100": [
        "model=llama3_405b",
        "cluster=dgx_h100",
        "cluster.nodes=2048",
        "train.seq_length=8192",
        "train.global_batch_size=2048",
    ],
    "gpt_1t @ 4,096 A100-40GB": [
        "model=gpt_1t",
        "cluster=dgx_a100_40g",
        "cluster.nodes=512",
        "train.seq_length=2048",
        "train.global_batch_size=3072",
    ],
    "gpt3_175b @ 1,024 A100-80GB": [
        "model=gpt3_175b",
        "cluster=dgx_a100_80g",
        "cluster.nodes=128",
        "train.seq_length=2048",
        "train.global_batch_size=1536",
    ],
    "mixtral_8x7b @ 4,096 H100": [
        "model=mixtral_8x7b",
        "cluster=dgx_h100",
        "cluster.nodes=512",
        "train.seq_length=4096",
        "train.global_batch_size=1024",
    ],
}


def run_once(argv):
    t0 = time.perf_counter()
    cfg, args = compose(argv)
    t1 = time.perf_counter()
    ctx = Context.from_config(cfg, describe(cfg.model), pinned_from_overrides(args.overrides))
    res = search(ctx)
    t2 = time.perf_counter()
    doc = report.build(ctx, res)
    t3 = time.perf_counter()
    return {"compose": t1 - t0, "search": t2 - t1, "report": t3 - t2, "plan": t3 - t1}, res, doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cli", type=int, default=3, help="end-to-end `mbr plan` runs for the first case")
    a = ap.parse_args()
    print(f"python {sys.version.split()[0]}, {a.repeat} in-process runs per case (min / median seconds)")
    first = True
    for name, argv in CASES.items():
        runs = [run_once(argv) for _ in range(a.repeat)]
        times = {k: [r[0][k] for r in runs] for k in runs[0][0]}
        _, res, doc = runs[-1]
        lo = doc["choice"]["layout"] if doc["choice"] else None
        chosen = (
            f"tp{lo['tp']} pp{lo['pp']} cp{lo['cp']} ep{lo['ep']} dp{lo['dp']} zero{lo['zero_stage']} {lo['recompute']}"
            if lo
            else "infeasible"
        )
        print(f"\n{name}: {res.candidates:,} candidates, {res.valid:,} valid, chosen {chosen}")
        for k, v in times.items():
            print(f"  {k:<8} {min(v):7.3f} / {statistics.median(v):7.3f}")
        if first and a.cli:
            cmd = [sys.executable, "-m", "megatron_bridge.cli", "plan", *argv]
            walls = []
            for _ in range(a.cli):
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, capture_output=True)
                walls.append(time.perf_counter() - t0)
            print(
                f"  mbr plan end to end (process start, imports, compose, search, table): "
                f"{min(walls):.3f} / {statistics.median(walls):.3f}"
            )
            target = min(times["plan"])
            print(f"  target < 2 s for the full search: {'PASS' if target < 2.0 else 'FAIL'} ({target:.3f} s)")
        first = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
