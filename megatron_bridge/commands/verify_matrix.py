"""`mbr verify --matrix`: the support matrix — every family × layout, with the evidence.

    mbr verify --matrix                                   # every family with a tiny model
    mbr verify --matrix 'verify.families=[qwen3_moe,gemma2]' 'verify.layouts=[tp2,ep2]'

For each family: a tiny random model of its transformers class with every feature of the
family switched on (`bridge/tiny.py`), transformers' fp32 reference, then one torchrun
launch over the layouts the rules accept (logits, loss, gradients and the bit-exact round
trip, exactly what `mbr verify` checks). Layouts a rule refuses are listed with the rule's
reason, not dropped. The output is the markdown table docs/bridge.md carries: measured
max-abs differences, not a yes/no flag.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_bridge.backends.describe import chosen_backend, describe
from megatron_bridge.bridge.tiny import TINY
from megatron_bridge.commands import verify_matrix_transformers
from megatron_bridge.commands.verify_setup import VerifyConfig, layouts_of, needed_world, reference
from megatron_bridge.config.compose import parse_command
from megatron_bridge.errors import LayoutError, UserError
from megatron_bridge.parallel.dims import ParallelDims
from megatron_bridge.parallel.rules.registry import validate
from megatron_bridge.runtime.parity import fold, grads_pass
from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import TorchrunError, run_torchrun

DENSE_LAYOUTS = ("tp1", "tp2", "pp2vpp2", "tp2pp2", "cp2")
MOE_LAYOUTS = ("ep2", "ep2tp2", "ep2tp2etp1")
CHECKS = ("logits", "grads", "roundtrip")
HEADER = "| family | layout | logits max-abs | loss abs-diff | grads max-abs (tensors) | round trip | verdict |"


def default_layouts(spec: Any) -> list[str]:
    return list(DENSE_LAYOUTS) + (list(MOE_LAYOUTS) if spec.is_moe else [])


def _refusals(cfg: Any, spec: Any, layouts: Sequence[Any], world: int) -> dict[str, str]:
    cfg.train.seq_length = cfg.verify.seq_length
    out = {}
    for lay in layouts:
        try:
            validate(cfg, spec, dims=lay.with_world(world), layout_only=True)
        except LayoutError as e:
            out[lay.describe()] = "; ".join(f"[{v.rule}] {v.detail}".replace("|", "/") for v in e.violations)
    return out


def _row(fam: str, key: str, f: dict[str, Any] | None, cfg: Any) -> str:
    if f is None:
        return f"| {fam} | {key} | - | - | - | - | FAIL: no rank reported |"
    tol, gtol = cfg.verify.tol, cfg.verify.grad_tol
    ok = f.get("logits_max", float("inf")) <= tol and f.get("loss_delta", float("inf")) <= gtol
    ok &= grads_pass(f, gtol)
    ok &= bool(f.get("rt_ok"))
    grads = f"{f.get('grads_max', float('nan')):.1e} ({f.get('grads_n', 0)}/{f.get('grads_want', 0)})"
    if f.get("grad_layout"):
        grads += f" as {f['grad_layout']}"
    rt = f"{f['rt_n']} bit-exact" if f.get("rt_ok") else "FAIL"
    return (
        f"| {fam} | {key} | {f.get('logits_max', float('nan')):.1e} | {f.get('loss_delta', float('nan')):.1e} "
        f"| {grads} | {rt} | {'OK' if ok else 'FAIL'} |"
    )


def _family(argv: Sequence[str], fam: str, root: Path) -> tuple[list[str], bool]:
    cfg, _ = parse_command(argv, VerifyConfig, doc=None)
    cfg.verify.checks = list(CHECKS)
    out = root / fam
    hf_dir = str(make_tiny(fam, out / "tiny"))
    spec = describe(cfg.model, hf_path=hf_dir)
    layouts = layouts_of(cfg, spec) if cfg.verify.layouts else [ParallelDims.parse(x) for x in default_layouts(spec)]
    world = cfg.verify.nproc or needed_world(layouts)
    refused = _refusals(cfg, spec, layouts, world)
    run = [lay for lay in layouts if lay.describe() not in refused]
    rows, ok = [], True
    per_rank: list[dict[str, Any]] = []
    if run:
        ref = reference(hf_dir, spec, cfg, out / "reference.pt")
        names = ",".join(lay.describe().replace("·", "") for lay in run)
        child = [
            "-m", "megatron_bridge.cli", "verify", f"verify.layouts=[{names}]",
            f"verify.checks=[{','.join(CHECKS)}]", f"verify.out={out}", f"model.hf_path={hf_dir}",
            f"verify.nproc={world}", "--worker",
        ]  # fmt: skip
        try:
            per_rank = [r.get("findings", {}) for r in run_torchrun(child, nproc=world, timeout=cfg.verify.timeout_s)]
        except TorchrunError as e:
            first = str(e).strip().splitlines()[-1:] or ["?"]
            return [f"| {fam} | {names} | - | - | - | - | FAIL: launch failed ({first[0][:120]}) |"], False
    for lay in layouts:
        key = lay.describe()
        if key in refused:
            rows.append(f"| {fam} | {key} | - | - | - | - | refused: {refused[key]} |")
            continue
        f = fold(per_rank, key, ref)
        row = _row(fam, key, f, cfg)
        ok &= row.endswith("| OK |")
        rows.append(row)
    return rows, ok


# a backend whose matrix is its own command, by `model.backend` (the rest: the native families' above)
MATRICES = {"transformers": verify_matrix_transformers.main}


def main(argv: Sequence[str]) -> int:
    """Print the matrix (markdown); exit 1 when any verified layout is over tolerance."""
    argv = [a for a in argv if a != "--matrix"]
    cfg, _ = parse_command(argv, VerifyConfig, doc=__doc__)
    own = MATRICES.get(chosen_backend(cfg.model))
    if own is not None:  # a backend's own catalogue (the transformers backend: every architecture with a tp plan)
        return own(argv)
    fams = list(cfg.verify.families) or list(TINY)
    unknown = [f for f in fams if f not in TINY]
    if unknown:
        raise UserError(f"verify.families {unknown}: tiny models exist for {', '.join(TINY)}")
    keep = [a for a in argv if not a.startswith("verify.families=")]
    print(HEADER)
    print("|" + "---|" * 7, flush=True)
    all_ok = True
    with tempfile.TemporaryDirectory(prefix="mbr-matrix-") as tmp:
        for fam in fams:
            rows, ok = _family(keep, fam, Path(cfg.verify.out or tmp))
            all_ok &= ok
            print("\n".join(rows), flush=True)
    return 0 if all_ok else 1


__all__ = ["main", "default_layouts", "DENSE_LAYOUTS", "MOE_LAYOUTS"]
