"""One rank of a two-"node" job: report which node (torchrun's GROUP_RANK) it runs on, its
TP group as megatron-core builds it, and (rank 0) the losses of a short training run."""

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
    run_dir, overrides = sys.argv[1], sys.argv[2:]
    cfg, _ = compose(overrides)
    groups.initialize(groups.dims_from_env(cfg, describe(cfg.model)))
    import torch
    from megatron.core import parallel_state as ps

    tp = torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    pp = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    assert train([*overrides, f"run_dir={run_dir}"], finalize=False) == 0
    out = {"node": int(os.environ["GROUP_RANK"]), "rank": torch.distributed.get_rank(), "tp_group": tp,
           "pp_group": pp}
    metrics = Path(run_dir) / "metrics.jsonl"
    if torch.distributed.get_rank() == 0:
        out["losses"] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    report(out)


if __name__ == "__main__":
    main()
