"""One rank of a two-"node" job: for each job (argv: RUN_ROOT then `name:override,override,...`,
one after another in this launch: startup dominates CPU test time), report which node
(torchrun's GROUP_RANK) it runs on, its TP and PP groups as megatron-core builds them, and
(rank 0) the losses of a short training run."""

import json
import os
import sys
from pathlib import Path

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.runtime import groups
from megatron_bridge.testing import report
from megatron_bridge.train.runner import train


def main() -> None:
    import torch
    from megatron.core import parallel_state as ps

    root, out = Path(sys.argv[1]), {}
    for job in sys.argv[2:]:
        name, overrides = job.split(":", 1)
        argv = overrides.split(",")
        cfg, _ = compose(argv)
        groups.initialize(groups.dims_from_env(cfg, describe(cfg.model)))
        tp = torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group())
        pp = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        assert train([*argv, f"run_dir={root / name}"], finalize=False) == 0, name
        out[name] = {"node": int(os.environ["GROUP_RANK"]), "rank": torch.distributed.get_rank(), "tp_group": tp,
                     "pp_group": pp}  # fmt: skip
        if torch.distributed.get_rank() == 0:
            rows = (root / name / "metrics.jsonl").read_text().splitlines()
            out[name]["losses"] = [json.loads(line)["loss"] for line in rows]
    report(out)


if __name__ == "__main__":
    main()
