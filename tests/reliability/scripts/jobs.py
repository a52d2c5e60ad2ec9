"""Run several training jobs in one torchrun launch, each optionally with an injected fault.

argv: OUT_DIR then one argument per job: `name|FAULT|override,override,...[|CODE]` (FAULT: an
`MBR_FAULT` spec, see megatron_bridge/reliability.py, or empty; CODE: the exit code the job
must end with, default 0 — a job ending otherwise is recorded in OUT_DIR/results.json as
`{"exit": CODE}`). Without torchrun it runs the jobs in one single process. Jobs share the process group
(startup dominates CPU test time). After each job that finishes, rank 0 adds its per-step
losses (from the run's metrics.jsonl) to OUT_DIR/results.json, so the results of the jobs
before a crash survive the crash; it also prints each job's wall time.
"""

import json
import os
import sys
import time
from pathlib import Path

from megatron_bridge.errors import run_cli
from megatron_bridge.train.runner import train


def main() -> None:
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0 and "MBR_T0" in os.environ:  # the harness's launch time: how long torchrun took to start us
        print(f"startup: {time.time() - float(os.environ['MBR_T0']):.1f} s", file=sys.stderr, flush=True)
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for job in sys.argv[2:]:
        name, fault, overrides, *want = job.split("|")
        os.environ.pop("MBR_FAULT", None)
        if fault:
            os.environ["MBR_FAULT"] = fault
        run_dir = out / "runs" / name
        t0 = time.perf_counter()
        code = run_cli(lambda argv: train(argv, finalize=False), [*overrides.split(","), f"run_dir={run_dir}"])
        assert code == int(want[0] if want else 0), (name, code)
        if rank == 0:
            print(f"job {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            path = out / "results.json"
            results = json.loads(path.read_text()) if path.exists() else {}
            results[name] = {str(r["step"]): r["loss"] for r in rows} if code == 0 else {"exit": code}
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(results))
            tmp.replace(path)


if __name__ == "__main__":
    main()
