"""Per job: build this rank's model as training does and count its parameters against the
planner's count for this pipeline stage, then train one step with `megatron_bridge.train`.

argv: OUT_DIR then one argument per job: `name:override,override,...` (all jobs in this one
launch). Every rank reports {name: {"built": n, "planned": n}}; training must return 0.
"""

import sys
from pathlib import Path

from megatron_bridge.testing import report


def count_job(overrides):
    import torch
    from megatron.core import parallel_state as ps

    from megatron_bridge.backends.describe import describe
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.config.compose import compose
    from megatron_bridge.runtime import groups
    from megatron_bridge.backends.registry import backend_of
    from megatron_bridge.plan.evaluation import stage_plan
    from megatron_bridge.train.job import model_overrides
    from megatron_bridge.train.runner import TrainRunConfig, validate_for_launch

    cfg, _ = compose(overrides, schema=TrainRunConfig)
    spec = describe(cfg.model)
    dims = validate_for_launch(cfg, spec)
    groups.initialize(dims, seed=0)
    chunks = build_model(spec, dims, **model_overrides(cfg))
    built = sum(p.numel() for c in chunks for p in c.parameters())
    pp_rank = ps.get_pipeline_model_parallel_rank()
    stages = {idx: (ids, first, last) for idx, ids, first, last in stage_plan(spec.num_layers, dims)}
    ids, first, last = stages[pp_rank]
    rp = backend_of(spec).shards(spec).rank_params(tp=dims.tp, ep=dims.ep, etp=dims.etp, layers=ids, first=first, last=last)
    del chunks
    groups.release()
    return {"built": built, "planned": rp["dense"] + rp["expert"], "pp_rank": pp_rank}


def main() -> None:
    from megatron_bridge.train.runner import train

    out = Path(sys.argv[1])
    results = {}
    for job in sys.argv[2:]:
        name, overrides = job.split(":", 1)
        overrides = overrides.split(",")
        results[name] = count_job(overrides)
        code = train([*overrides, f"run_dir={out / name}"], finalize=False)
        results[name]["trained"] = code
    report({"jobs": results})


if __name__ == "__main__":
    main()
