"""`mbr verify`: does the megatron model built by the bridge compute what transformers does?

    mbr verify model.hf_path=DIR parallel.tp=2 parallel.pp=2
    mbr verify model.hf_path=DIR 'verify.layouts=[tp1,tp2pp2,cp2tp2,ep2]' 'verify.checks=[logits,roundtrip,grads]'
    mbr verify verify.tiny=mixtral 'verify.layouts=[ep2tp2]'      # a tiny random model of a family
    mbr verify verify.tiny=cohere 'verify.layouts=[tp2,pp2]'      # ... or of a transformers-backend architecture
    mbr verify model.backend=transformers model.hf_path=DIR 'verify.layouts=[tp2,pp2,tp2pp2]'  # transformers' modeling code
    mbr verify --list                                              # supported families
    mbr verify --matrix                                            # every family x layout, measured

Two phases. (1) transformers, one process, fp32 on CPU: logits (and, for `grads`, loss and
every tensor's gradient) for a fixed random batch. (2) megatron under torchrun (gloo on CPU,
NCCL on GPU) — started here with as many local processes as the layouts need, or the ranks
of an enclosing `torchrun ... -m megatron_bridge.cli verify ...`: for each layout, build the
model, load the HF weights (each rank reads its slices), run the forward through megatron's
pipeline schedule and compare; `roundtrip` exports back to HF and compares every tensor
bit-exactly; `grads` compares gradients. Prints max-abs / mean-abs per layout; exit 1 when
any layout is over tolerance, 2 on a user error.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.backends.describe import describe
from megatron_bridge.bridge.registry import describe as describe_families
from megatron_bridge.commands import verify_matrix
from megatron_bridge.commands.verify_setup import (
    VerifyConfig,
    layouts_of,
    needed_world,
    prepare,
    reference,
)
from megatron_bridge.config.compose import parse_command
from megatron_bridge.errors import UserError
from megatron_bridge.runtime import groups
from megatron_bridge.runtime.parity import check_layout, dims_for, summarize
from megatron_bridge.testing import TorchrunError, report, run_torchrun


def _launched(cfg, worker: bool) -> int:
    """Phase 2 on every rank of a torchrun launch (ours with --worker, or the user's)."""
    layouts = layouts_of(cfg, describe(cfg.model))  # parallel.* resolved for the model the recipe names
    world = int(os.environ["WORLD_SIZE"])
    out = Path(cfg.verify.out or Path(tempfile.gettempdir()) / f"mbr-verify-{os.environ.get('MASTER_PORT', '0')}")
    groups.initialize(dims_for(layouts[0], world), timeout_minutes=cfg.train.timeout_minutes)
    rank = torch.distributed.get_rank()
    shared: list[Any] = [None, None]
    if rank == 0:  # one rank builds the tiny model / the reference; the others wait for its verdict
        try:
            out.mkdir(parents=True, exist_ok=True)
            hf_dir, spec, _ = prepare(cfg, out)
            if not (out / "reference.pt").is_file():
                reference(hf_dir, spec, cfg, out / "reference.pt")
            shared = [None, hf_dir]
        except UserError as e:
            shared = [str(e), None]
    torch.distributed.broadcast_object_list(shared, src=0)
    if shared[0]:
        raise UserError(shared[0])
    hf_dir = shared[1]
    spec = describe(cfg.model, hf_path=hf_dir)
    ref = torch.load(out / "reference.pt", weights_only=True)  # written by phase 1; still data only
    mine: dict[str, Any] = {}
    for lay in layouts:
        t0 = time.perf_counter()
        res = check_layout(
            hf_dir,
            lay,
            list(cfg.verify.checks),
            ref=ref,
            input_ids=ref["input_ids"],
            labels=ref["labels"],
            export_dir=out / lay.describe().replace("·", "").replace(" ", ""),
            make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
            backend=spec.backend,
            weights=cfg.verify.checkpoint,
            images=ref.get("images"),
        )
        res["seconds"] = round(time.perf_counter() - t0, 2)
        mine[lay.describe()] = res
    if worker:
        report({"findings": mine})
        return 0
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, mine)
    ok = _print_summary(everyone, layouts, cfg, ref, hf_dir, spec) if rank == 0 else True
    torch.distributed.barrier()
    return 0 if ok else 1


def _print_summary(per_rank, layouts, cfg, ref, hf_dir, spec) -> bool:
    print(
        f"verify {spec.architecture} ({spec.family}, {spec.backend} backend) from {hf_dir}: batch "
        f"{'×'.join(map(str, ref['input_ids'].shape))}{', one image per sample' if 'images' in ref else ''}, fp32, "
        f"checks {', '.join(cfg.verify.checks)}"
    )
    all_ok = True
    for lay in layouts:
        lines, ok = summarize(per_rank, lay.describe(), cfg.verify.checks, ref, cfg.verify.tol, cfg.verify.grad_tol)
        all_ok &= ok
        secs = max((r.get(lay.describe(), {}).get("seconds", 0) for r in per_rank), default=0)
        print(f"layout {lay.describe()}  ({secs:.1f} s)  {'OK' if ok else 'FAIL'}")
        for line in lines:
            print(f"  {line}")
    print("all layouts OK" if all_ok else "FAILED: some layouts are over tolerance")
    return all_ok


def main(argv: Sequence[str]) -> int:
    if "--matrix" in argv and "WORLD_SIZE" not in os.environ:
        return verify_matrix.main(argv)
    if "--list" in argv:
        print(describe_families())
        return 0
    cfg, args = parse_command(argv, VerifyConfig, doc=__doc__)
    if "WORLD_SIZE" in os.environ:
        return _launched(cfg, worker="--worker" in args.flags)
    with tempfile.TemporaryDirectory(prefix="mbr-verify-") as tmp:
        out = Path(cfg.verify.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        hf_dir, spec, layouts = prepare(cfg, out)
        ref = reference(hf_dir, spec, cfg, out / "reference.pt")
        nproc = cfg.verify.nproc or needed_world(layouts)
        child = [
            a
            for a in argv
            if not a.startswith(("verify.out=", "verify.tiny=", "model.hf_path=", "src=", "verify.nproc="))
        ]
        child += [f"verify.out={out}", f"model.hf_path={hf_dir}", f"verify.nproc={nproc}", "--worker"]
        print(f"running {len(layouts)} layout(s) on {nproc} local process(es) ...", flush=True)
        try:
            results = run_torchrun(
                ["-m", "megatron_bridge.cli", "verify", *child], nproc=nproc, timeout=cfg.verify.timeout_s
            )
        except TorchrunError as e:
            raise UserError(f"the megatron side failed:\n{e}") from e
        per_rank = [r.get("findings", {}) for r in results]
        return 0 if _print_summary(per_rank, layouts, cfg, ref, hf_dir, spec) else 1
