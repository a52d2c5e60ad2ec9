"""Chaos run: N random faults over a few hundred steps of one restarting job; goodput, and
every step's loss (recomputed steps included) against an uninterrupted run.

One reference launch without faults, then the chaos run: `mbr launch max_restarts=N` (torchrun,
c10d, `checkpoint.resume=auto`), 2 ranks, with `MBR_FAULT` planning fault k of the schedule in
attempt k, each at a later step than the one before (so every attempt reaches its fault). The
kinds: `kill` (SIGKILL), `raise` (an error in one rank), `hang` (the watchdog,
`train.timeout_minutes`, ends the attempt), `stop` (SIGSTOP: a frozen host; peers' watchdogs
fire, torchrun SIGKILLs it after its 30 s stop grace) and `term` (a preemption notice: every
rank saves that step and the job exits 0 — a scheduler's requeue, played here by launching
the same command again). The script prints each fault's cost from the run's attempts ledger
(train/attempts.py), the goodput, and whether every logged loss equals the reference's.

    .venv/bin/python benchmarks/chaos.py [--faults 6] [--steps 300] [--save-interval 10]
        [--nproc 2] [--seed 0] [--kinds kill,raise,hang,stop,term] [--timeout-min 0.1] [--step-s 0]

`--step-s S` pads every step of both runs by S seconds (the `slow` fault on every rank): the
tiny CPU model's 40 ms steps make restarts look huge next to the work; padded steps give the
ratio of a real run. The ledger's per-fault split between recompute and restart is at ~1 s
resolution (its writes are throttled), their sum is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_bridge.testing import free_port  # noqa: E402
from megatron_bridge.train import attempts  # noqa: E402

FIRED = re.compile(r"injecting (\w+):step:(\d+):(\d+):(\d+)")


def schedule(a: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(kind, rank, step) of each fault, steps increasing; every kind at least once when N allows."""
    rng = random.Random(a.seed)
    kinds = a.kinds.split(",")
    picks = (rng.sample(kinds, len(kinds)) * (a.faults // len(kinds) + 1))[: a.faults]
    rng.shuffle(picks)
    steps = sorted(rng.sample(range(a.save_interval + 1, a.steps), a.faults))
    return [(k, rng.randrange(a.nproc), s) for k, s in zip(picks, steps, strict=True)]


def launch(a: argparse.Namespace, tmp: Path, name: str, plan: list[tuple[str, int, int]]) -> tuple[int, str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("MBR_FAULT", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    faults = [f"{k}:step:{r}:{s}:{i}" for i, (k, r, s) in enumerate(plan)]
    if a.step_s:  # every rank sleeps in every step (after the planned faults: the first match fires)
        faults.append("slow:step:*:*")
        env["MBR_FAULT_SLOW_S"] = str(a.step_s)
    env["MBR_FAULT"] = ",".join(faults)
    cmd = [
        sys.executable, "-m", "megatron_bridge.cli", "launch", "recipe=default", "data=synthetic",
        f"cluster.gpus_per_node={a.nproc}", f"cluster.master_port={free_port()}", f"max_restarts={len(plan)}",
        f"train.steps={a.steps}", "train.seq_length=32", "train.global_batch_size=4", "optimizer.warmup_steps=10",
        f"checkpoint.save_interval={a.save_interval}", "checkpoint.resume=auto", f"train.timeout_minutes={a.timeout_min}",
        "logger.tensorboard.enabled=false", f"checkpoint.dir={tmp / name / 'ck'}", f"run_dir={tmp / name / 'run'}",
    ]  # fmt: skip
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def losses(run: Path) -> list[tuple[int, float]]:
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", type=int, default=6)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-interval", type=int, default=10)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="kill,raise,hang,stop,term")
    ap.add_argument("--step-s", type=float, default=0.0, help="pad every step by this many seconds (a longer step)")
    ap.add_argument("--timeout-min", type=float, default=0.1, help="train.timeout_minutes (the watchdog)")
    a = ap.parse_args()
    plan = schedule(a)
    print("faults: " + ", ".join(f"{k} rank {r} step {s}" for k, r, s in plan), flush=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rc, out, ref_wall = launch(a, tmp, "ref", [])
        if rc:
            print(out[-4000:])
            return 1
        want = dict(losses(tmp / "ref" / "run"))
        left, launches, wall = list(plan), 0, 0.0
        while True:  # a `term` ends a launch cleanly: launch the same command again (a requeue)
            rc, out, w = launch(a, tmp, "chaos", left)
            launches, wall = launches + 1, wall + w
            fired = FIRED.findall(out)
            if rc:
                print(out[-6000:])
                print(f"error: the chaos launch exited {rc} after {len(fired)} fault(s) of {len(left)}")
                return 1
            led = attempts.read(tmp / "chaos" / "ck")["attempts"]
            if led[-1]["outcome"] == "finished":
                break
            left = left[len(fired) :]  # the last one fired was a term: the rest go to the next launch
        got = losses(tmp / "chaos" / "run")
        bad = [(s, v, want.get(s)) for s, v in got if v != want.get(s)]
        steps = {s for s, _ in got}
        pad = f", steps padded by {a.step_s:g} s" if a.step_s else ""
        print(f"reference: {a.steps} steps{pad}, {ref_wall:.1f} s wall (one launch)")
        print(f"chaos: {len(plan)} faults, {launches} launch(es), {len(led)} attempts, {wall:.1f} s wall")
        kinds = [k for k, _, _ in plan]
        for kind, f in zip(kinds, attempts.faults(led), strict=False):
            print(f"  {kind:5s} {f.line()}")
        print(attempts.summary(led).splitlines()[0])
        print(
            f"losses: {len(got)} logged rows ({len(got) - len(steps)} recomputed), steps 1-{a.steps} "
            f"{'all present' if steps == set(range(1, a.steps + 1)) else 'MISSING some'}; "
            + ("every one equal bit for bit to the reference" if not bad else f"{len(bad)} differ, e.g. {bad[:3]}")
        )
        return 0 if not bad and steps == set(range(1, a.steps + 1)) else 1


if __name__ == "__main__":
    sys.exit(main())
