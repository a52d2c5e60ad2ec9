"""Run `megatron_bridge.train` for several layouts inside one torchrun launch.

argv: OUT_DIR then one argument per job: `name:override,override,...` (a list value's commas,
inside its brackets, stay in it). Each job trains in
this same process group (startup dominates CPU test time); rank 0 reports each job's
per-step losses and grad norms (and `val_loss` at the steps that evaluated) read back from the run's
metrics.jsonl, and the graph breaks dynamo met during each job (`train.compile`). A job `name:mbr,ARG,ARG,...` runs `mbr ARG ...` on rank 0 instead (an `mbr reshard`
between two trainings), the other ranks waiting at a barrier.
"""

import json
import re
import sys
from pathlib import Path

from megatron_bridge.runtime.compiled import graph_breaks
from megatron_bridge.testing import report
from megatron_bridge.train.runner import train


def main() -> None:
    out = Path(sys.argv[1])
    results, val, grads, breaks = {}, {}, {}, {}
    for job in sys.argv[2:]:
        name, overrides = job.split(":", 1)
        if overrides.startswith("mbr,"):
            import torch

            from megatron_bridge.cli import main as mbr

            if torch.distributed.get_rank() == 0:
                assert mbr(overrides.split(",")[1:]) == 0, name
            torch.distributed.barrier()
            continue
        run_dir = out / name
        before = graph_breaks()
        code = train([*re.split(r",(?![^\[]*\])", overrides), f"run_dir={run_dir}"], finalize=False)
        assert code == 0, (name, code)
        breaks[name] = sum((graph_breaks() - before).values())
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            results[name] = {str(r["step"]): r["loss"] for r in rows}
            val[name] = {str(r["step"]): r["val_loss"] for r in rows if "val_loss" in r}
            grads[name] = {str(r["step"]): r["grad_norm"] for r in rows}
    report({"losses": results, "val_losses": val, "grad_norms": grads, "graph_breaks": breaks})


if __name__ == "__main__":
    main()
