"""Parity checks between a bridged megatron model and its transformers oracle.

Shared by `mbr verify` and the distributed tests, so what CI checks is what users run:

* `hf_reference` — transformers in fp32 on CPU: logits, mean token cross-entropy and the
  gradient of every HF tensor for a fixed batch (computed once, in one process).
* `check_layout` — on every rank of a launch: initialize the layout's groups, build, load,
  then any of: logits vs the reference (`logits`), gradients vs the reference (`grads`),
  export and compare every tensor bit-exactly with the source (`roundtrip`), one SGD step
  then export (`train`, compared by the caller with `source - lr·grad`).

Gradient-based checks build the model with `make_vocab_size_divisible_by=1`: megatron's
padded vocab rows take part in the softmax (zero logits), which changes the loss against
HF's unpadded vocab; with no padding beyond a multiple of tp the two losses are identical.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.features.mtp import mtp_keys
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import HFCheckpoint
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.errors import UserError
from megatron_bridge.runtime import groups
from megatron_bridge.runtime.build import build_model, check_groups
from megatron_bridge.runtime.load_converted import load_megatron
from megatron_bridge.runtime.schedule import forward_backward, forward_logits, sgd_step, unwrap, wrap_ddp
from megatron_bridge.runtime.weights import export_hf_weights, iter_hf_tensors, load_hf_weights

CHECKS = ("logits", "grads", "roundtrip", "train")


def make_batch(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    labels = torch.randint(0, vocab_size, (batch, seq), generator=g)
    return ids, labels


def hf_reference(
    hf_dir: str | Path,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    aux_loss: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """transformers' fp32 logits (and, with labels, loss and per-tensor grads). `aux_loss`:
    include transformers' router load-balancing term where the config switches it on (what
    the transformers backend trains with); False for the native backend, whose MoE layers do not add it.
    `dtype` float64: the same in fp64 (experts unfused: grouped_mm has no fp64 kernel), the
    exact answer fp32 rounding is measured against (`grad_floor` in commands/verify_matrix_transformers.py).

    Grads are keyed by *checkpoint* names: transformers 5 keeps MoE experts fused in memory
    (`experts.gate_up_proj`) but saves them per expert, so the grads are written through
    `save_pretrained` (its own name/layout conversion) and read back."""
    if read_hf_config(hf_dir).get("quantization_config"):
        # an fp8 block-quantised source: the reference is transformers' own bf16 dequantisation
        # (what the bridge loads), computed in fp32 like every other reference
        model = AutoModelForCausalLM.from_pretrained(
            str(hf_dir), dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(dequantize=True)
        )
        model = model.float().eval()
        for attr in ("hf_quantizer", "_weight_conversions"):  # grads are saved below: not re-quantised
            setattr(model, attr, None)
        model.config.quantization_config = None
    else:
        extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, **extra).eval()
    out: dict[str, Any] = {}
    with torch.set_grad_enabled(labels is not None):
        res = model(input_ids)
        logits = res.logits.to(dtype)
        out["logits"] = logits.detach().float()
        if labels is None:
            return out
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if aux_loss and getattr(res, "aux_loss", None) is not None:
            # transformers' load-balancing loss (config.output_router_logits) of each one-sample
            # micro-batch the schedule runs, averaged as their token losses are (runtime/transformers/aux_loss.py)
            aux = torch.stack([model(row[None]).aux_loss for row in input_ids]).mean()
            loss = loss + model.router_aux_loss_coef * aux
        loss.backward()
    out["loss"] = float(loss.detach())
    out["grads"] = saved_grads(model)
    return out


def saved_grads(model: Any) -> dict[str, torch.Tensor]:
    """Every tensor save_pretrained writes, as its gradient, keyed by its checkpoint name: the
    grads copied into the parameters (a parameter without one: zeros), saved, read back. Saved
    buffers (DeepSeek-V3's correction bias, Qwen4-Exp's integer n-gram hash multipliers) are
    frozen: grad 0, as the bridge reports them. Overwrites the model's weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))
        saved = model.state_dict()
        for name, b in model.named_buffers():
            if name in saved:
                b.zero_()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_dir(tmp)


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient; zero for a frozen one (requires_grad=False has no main_grad)."""
    return p.main_grad if p.requires_grad else torch.zeros_like(p)  # type: ignore[attr-defined]


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.float() - b.float()).abs()
    return {
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "mean_abs": float(d.mean()) if d.numel() else 0.0,
        "ref_max": float(b.abs().max()) if b.numel() else 0.0,
    }


def dims_for(layout: Layout, world_size: int) -> Layout:
    mp = layout.model_parallel
    if world_size % mp:
        raise ValueError(f"layout {layout.describe()} needs a multiple of {mp} processes, have {world_size}")
    return layout.with_world(world_size)


def ensure_groups(layout: Layout, world_size: int) -> None:
    """Initialize the layout's process groups unless the current ones already match
    (sequence parallelism needs no groups of its own)."""
    try:
        check_groups(layout)
        return
    except UserError:
        groups.initialize(dims_for(layout, world_size))


# Gradients pass where |mine - transformers'| <= grad_tol + GRAD_RTOL * |transformers'| element by
# element (torch.allclose's form): an fp32 gradient of magnitude ~1 summed in another order (a
# vocab-parallel head, a TP split) moves by ~1e-5 relative; transformers' own fp32 gradient is
# no closer to its fp64 one there (the tiny Gemma 4's tied embedding: 2.4-5e-5, docs/bridge.md).
GRAD_RTOL = 1e-5


def _compare_dict(
    mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], exact: bool, floor: dict[str, float] | None = None
) -> dict[str, Any]:
    """exact: bit equality; else the largest |difference| ("max_abs", with its tensor) and the
    largest excess over the relative allowance ("max_over": |d| - GRAD_RTOL·|ref| - floor[name],
    where `floor` is the reference's own fp32 error on that tensor, when the caller measured it)."""
    floor = floor or {}
    worst, name, bad, over = 0.0, None, [], 0.0
    for k, t in mine.items():
        if k not in ref:
            bad.append(f"{k}: not in reference")
            continue
        r = ref[k].to(t.device)  # the reference is computed on the CPU
        if tuple(t.shape) != tuple(r.shape) or t.dtype != r.dtype and exact:
            bad.append(f"{k}: {tuple(t.shape)}/{t.dtype} vs {tuple(r.shape)}/{r.dtype}")
            continue
        if exact:
            if not torch.equal(t, r):
                bad.append(f"{k}: values differ")
            continue
        if not t.numel():
            continue
        delta = (t.float() - r.float()).abs()
        d = float(delta.max())
        over = max(over, float((delta - GRAD_RTOL * r.float().abs()).max()) - floor.get(k, 0.0))
        if d >= worst:
            worst, name = d, k
    return {"n": len(mine), "max_abs": worst, "max_over": over, "worst": name, "bad": bad}


def _load(chunks: Sequence[Any], spec: BridgeSpec, hf_dir: str | Path, weights: str | Path | None) -> None:
    if weights:
        with torch.no_grad():
            load_megatron(chunks, spec, weights)
    else:
        load_hf_weights(chunks, spec, hf_dir)


def check_layout(
    hf_dir: str | Path,
    layout: Layout,
    checks: Sequence[str],
    *,
    ref: dict[str, Any] | None = None,
    input_ids: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    export_dir: str | Path | None = None,
    lr: float = 0.5,
    init_groups: bool = True,
    make_vocab_size_divisible_by: int = 8,
    backend: str = "auto",
    weights: str | Path | None = None,
    images: Sequence[dict] | None = None,
) -> dict[str, Any]:
    """Run `checks` for one (model, layout) on every rank of the launch; returns this rank's
    findings (empty entries on ranks that hold nothing to compare). `backend` (auto | native
    | hf) describes the model as `model.backend` does; `weights`: a Megatron-written checkpoint
    the megatron side loads instead of `hf_dir` (`hf_dir` is then its HF export); `images`: a
    VLM's image inputs, one dict per sample (runtime/vision_inputs.py)."""
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; choose from {CHECKS}")
    world = (
        torch.distributed.get_world_size()
        if torch.distributed.is_initialized()
        else int(os.environ.get("WORLD_SIZE", "1"))
    )
    if init_groups:
        ensure_groups(layout, world)
    rank = torch.distributed.get_rank()
    hf = read_hf_config(hf_dir)
    out: dict[str, Any] = {}
    if "logits" in checks or "roundtrip" in checks:
        spec = describe_hf(hf, make_vocab_size_divisible_by=make_vocab_size_divisible_by, backend=backend)
        chunks = build_model(spec, layout, load_weights=True)
        _load(chunks, spec, hf_dir, weights)
        if "logits" in checks:
            assert input_ids is not None and ref is not None, "the logits check needs input_ids and ref"
            logits = forward_logits(chunks, input_ids, images)
            if logits is not None:
                out["logits"] = diff(logits[..., : spec.vocab_size], ref["logits"])
                out["logits"]["padded_vocab"] = int(logits.shape[-1])
        if "roundtrip" in checks:
            assert export_dir is not None, "the roundtrip check needs export_dir"
            dest = Path(export_dir) / "roundtrip"
            export_hf_weights(chunks, spec, dest, source_dir=hf_dir)
            if rank == 0:
                out["roundtrip"] = compare_dirs(dest, hf_dir, spec)
        del chunks
    if "grads" in checks or "train" in checks:
        spec = describe_hf(hf, make_vocab_size_divisible_by=1, backend=backend)
        glayout = training_layout(spec, layout)
        if glayout != layout:
            out["grad_layout"] = glayout.describe()
        chunks = build_model(spec, glayout, load_weights=True)
        _load(chunks, spec, hf_dir, weights)
        ddp = wrap_ddp(chunks)
        assert input_ids is not None and labels is not None, "the grads and train checks need input_ids and labels"
        loss = forward_backward(ddp, input_ids, labels, train="train" in checks, images=images)
        if loss is not None:
            out["loss"] = {"value": loss, "ref": ref.get("loss") if ref else None}
        if "grads" in checks:
            assert ref is not None, "the grads check needs ref"
            grads = dict(iter_hf_tensors(unwrap(ddp), spec, value=_grad_of))
            out["grads"] = _compare_dict(grads, ref["grads"], exact=False, floor=ref.get("grad_floor"))
        if "train" in checks:
            assert export_dir is not None, "the train check needs export_dir"
            sgd_step(ddp, lr)
            dest = Path(export_dir) / "trained"
            export_hf_weights(unwrap(ddp), spec, dest, source_dir=hf_dir)
            out["train_dir"] = str(dest)
        del ddp, chunks
    return out


def training_layout(spec: Any, layout: Layout) -> Layout:
    """megatron-core needs sequence parallelism to train MoE with TP (it refuses training
    mode otherwise, and without SP the expert weight gradients come out wrong), so gradient
    checks of MoE models at tp > 1 turn SP on. Not where the backend cannot run the model
    with SP (a transformers-backend plan style SP does not cover): the transformers backend's experts are exact at
    TP without SP (runtime/transformers/experts.py `ExpertsTP`), megatron's MoE layer is not run there."""
    if layout.sequence_parallel_required(spec.is_moe, layout.tp) and not layout.sequence_parallel:
        sp = dataclasses.replace(layout, sequence_parallel=True)
        backend = backend_of(spec)
        if len(backend.layout_limits(spec, sp)) > len(backend.layout_limits(spec, layout)):
            return layout
        return sp
    return layout


def load_dir(path: str | Path) -> dict[str, torch.Tensor]:
    with HFCheckpoint(path) as ck:
        return {k: ck.tensor(k) for k in ck.keys()}


def compare_dirs(got: str | Path, want: str | Path, spec: Any = None) -> dict[str, Any]:
    """Bit-exact comparison of two HF directories' tensors (names, shapes, dtypes, values).
    An fp32 export of a bf16/fp16 source (verify's models are fp32) is compared in the
    source's dtype: the cast back is exact when the weights came through unchanged. With
    `spec`, the source's multi-token-prediction layers are not expected back (the bridge
    skips them on load, with a note, and export says it did not write them)."""
    a, b = load_dir(got), load_dir(want)
    for k in mtp_keys(spec, list(b)) if spec is not None else []:
        del b[k]
    for k, t in a.items():
        if k in b and t.dtype == torch.float32 and b[k].dtype in (torch.bfloat16, torch.float16):
            a[k] = t.to(b[k].dtype)
    res = _compare_dict(a, b, exact=True)
    missing = sorted(set(b) - set(a))
    res["bad"] += [f"{k}: missing from export" for k in missing]
    res["ok"] = not res["bad"]
    return res


def fold(per_rank: Sequence[dict[str, Any]], key: str, ref: dict[str, Any]) -> dict[str, Any] | None:
    """Every rank's findings for `key` (one model under one layout) as numbers: logits come
    from the last pipeline stage, grads from the writing replicas (their counts add up to the
    number of HF tensors), the round trip from rank 0. None when no rank reported."""
    found = [r[key] for r in per_rank if key in r]
    if not found:
        return None
    out: dict[str, Any] = {}
    got = [f["logits"] for f in found if "logits" in f]
    if got:
        out.update(
            logits_max=max(g["max_abs"] for g in got),
            logits_mean=max(g["mean_abs"] for g in got),
            padded_vocab=got[0]["padded_vocab"],
        )
    losses = [f["loss"]["value"] for f in found if "loss" in f]
    if "loss" in ref and losses:
        out.update(loss=losses[0], loss_delta=max(abs(v - ref["loss"]) for v in losses))
    g = [f["grads"] for f in found if f.get("grads", {}).get("n")]
    if g:
        out.update(
            grads_n=sum(x["n"] for x in g),
            grads_want=len(ref.get("grads", {})),
            grads_max=max(x["max_abs"] for x in g),
            grads_over=max(x.get("max_over", x["max_abs"]) for x in g),  # what the verdict compares
            grads_bad=[b for x in g for b in x["bad"]],
            grads_worst=max(g, key=lambda x: x["max_abs"]).get("worst"),
        )
    out["grad_layout"] = next((f["grad_layout"] for f in found if "grad_layout" in f), None)
    rt = [f["roundtrip"] for f in found if "roundtrip" in f]
    if rt:
        out.update(rt_ok=bool(rt[0]["ok"]), rt_n=rt[0]["n"], rt_bad=rt[0]["bad"])
    return out


def grads_pass(f: dict[str, Any], grad_tol: float) -> bool:
    """`fold`'s gradient verdict, the one every report uses: every HF tensor compared, none
    bad, and no element beyond grad_tol + GRAD_RTOL·|ref| (a hand-built row without the
    relative excess: its max-abs)."""
    over = f.get("grads_over", f.get("grads_max", float("inf")))
    return f.get("grads_n") == f.get("grads_want") and not f.get("grads_bad") and over <= grad_tol


def summarize(
    per_rank: Sequence[dict[str, Any]],
    key: str,
    checks: Sequence[str],
    ref: dict[str, Any],
    tol: float = 1e-4,
    grad_tol: float = 1e-5,
) -> tuple[list[str], bool]:
    """`fold`'s numbers as report lines and a verdict."""
    f = fold(per_rank, key, ref)
    if f is None:
        return [f"{key}: no rank reported"], False
    lines, ok = [], True
    if "logits" in checks:
        good = "logits_max" in f and f["logits_max"] <= tol
        if "logits_max" in f:
            lines.append(
                f"logits      max-abs {f['logits_max']:.3e}  mean-abs {f['logits_mean']:.3e}  (tol {tol:g}, "
                f"padded vocab {f['padded_vocab']})  {'OK' if good else 'FAIL'}"
            )
        else:
            lines.append("logits      no rank produced logits  FAIL")
        ok &= good
    if ("grads" in checks or "train" in checks) and "loss" in f:
        good = f["loss_delta"] <= grad_tol
        lines.append(
            f"loss        {f['loss']:.6f} vs transformers {ref['loss']:.6f} (|Δ| {f['loss_delta']:.2e})  "
            f"{'OK' if good else 'FAIL'}"
        )
        ok &= good
    if "grads" in checks:
        n, want = f.get("grads_n", 0), len(ref.get("grads", {}))
        worst, bad = f.get("grads_max", float("inf")), f.get("grads_bad", [])
        good = n == want and grads_pass(f, grad_tol)
        note = f["grad_layout"]
        lines.append(
            f"grads       {n}/{want} tensors  max-abs {worst:.3e}  (tol {grad_tol:g} + {GRAD_RTOL:g}·|ref|"
            f"{', run as ' + note if note else ''})  {'OK' if good else 'FAIL'}"
            + (f"  {bad[:3]}" if bad else "")
            + (f"  worst {f['grads_worst']}" if not good and f.get("grads_worst") else "")
        )
        ok &= good
    if "roundtrip" in checks:
        good = bool(f.get("rt_ok"))
        detail = f"{f['rt_n']} tensors bit-exact" if good else (f["rt_bad"][:3] if "rt_bad" in f else "not run")
        lines.append(f"round trip  {detail}  {'OK' if good else 'FAIL'}")
        ok &= good
    return lines, ok


__all__ = [
    "CHECKS",
    "make_batch",
    "hf_reference",
    "grads_pass",
    "diff",
    "dims_for",
    "check_layout",
    "compare_dirs",
    "load_dir",
    "saved_grads",
    "training_layout",
    "summarize",
    "fold",
]
