"""`mbr verify --matrix model.backend=transformers`: every architecture transformers ships with a tp plan.

    mbr verify --matrix model.backend=transformers                                  # all of them
    mbr verify --matrix model.backend=transformers 'verify.families=[cohere,phi]' 'verify.layouts=[tp2]'
    mbr verify --matrix model.backend=transformers 'verify.families=[mixtral,qwen3_moe]'  # a subset of rows
    mbr verify --matrix model.backend=transformers 'verify.checks=[convert]'        # the checkpoint round trips alone
    mbr verify --matrix model.backend=transformers verify.vlm=true                  # the vision-language models

For each architecture of `runtime/hf_tiny.architectures()`: its tiny model (`make_tiny`, its
distinctive features on, constant weights perturbed), described with the transformers backend in this
process. A description the backend refuses gives one `refused` row with the refusal's first
line; a layout the backend refuses (`layout_limits`) gives a refused row for that layout. The
others get transformers' fp32 reference here, then run in grouped torchrun launches (4 processes,
`GROUP` architectures each, every layout in one launch): logits, loss, every gradient and the
bit-exact HF round trip, as `mbr verify` checks them, each gradient allowed on top
the fp32 rounding transformers itself shows on that tensor against its fp64 run (`grad_floor`). An exception inside the launch ends it
at once (a rank that raised may leave the others waiting on it, so going on could hang); the
group's architectures are then retried alone once, and the one that raises is a FAIL row with
its exception's line, as is one that leaves no report (a hang, a crash). Every described
architecture also makes the checkpoint round trip offline, in this process (`convert_round_trip`):
`mbr convert` to torch_dist and to per-rank files at the widest layout the backend allows
(tp2·pp2, with ep2 for MoE), then `mbr export` of each must give the source's every tensor back,
names, dtypes, shapes and bytes; its result is the table's "convert ⇄ export" column and a row
passes only with it. The output is the table docs/bridge.md carries.

`verify.vlm=true`: the same over every image-text-to-text type whose language model has a tp plan
(`hf_tiny.vlm_architectures()`), each built as its VLM class and fed one random image per sample
(runtime/vision_inputs.py); the gradients get no fp64 floor (the plain verdict). Its table is
docs/vlm.md's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.backends.transformers.backend import TransformersBackend
from megatron_bridge.backends.transformers.loading import needs_package
from megatron_bridge.backends.transformers.vision import image_text_class_name
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.commands.verify_setup import VerifyConfig, image_reference
from megatron_bridge.config.compose import parse_command
from megatron_bridge.errors import UserError
from megatron_bridge.runtime.hf_tiny import architectures, make_tiny, tiny_config, vlm_architectures
from megatron_bridge.runtime.parity import check_layout, fold, grads_pass, hf_reference, make_batch
from megatron_bridge.testing import TorchrunError, report, run_torchrun

LAYOUTS = ("tp2", "pp2", "tp2pp2", "ep2")
# run when verify.layouts names them: context parallelism, and MoE at ep2·tp2 with sequence
# parallelism (the MoE bar; TP-split experts need SP, as the moe-tp-sp rule says)
ACCEPTED = (*LAYOUTS, "cp2", "tp2cp2", "ep2tp2sp")
NOT_MOE = "n/a"  # an ep layout of a dense model: no row
CHECKS = ("logits", "grads", "roundtrip")
NPROC = 4
GROUP = 12  # architectures per torchrun launch
TOL = 1e-5  # fp32: logits, loss and every gradient
ERROR_MARK = "hf-matrix error: "  # a worker's exception, printed as it ends the launch
HEADER = (
    "| architecture | layout | logits max-abs | loss abs-diff | grads max-abs (tensors) | round trip "
    "| convert ⇄ export | verdict |"
)
CONVERT_HEADER = "| architecture | convert ⇄ export | verdict |"
PER_RANK = ("ep2tp2pp2", "tp2pp2", "ep2pp2", "pp2", "tp2", "ep2")  # the first the backend allows is converted to
CONVERT_OK = "bit-exact"


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split()).replace("|", "/")
    return line if len(line) <= limit else line[: limit - 1] + "…"


def refusal(exc: BaseException) -> str:
    """The refusal's one line: the first reason a multi-line refusal lists."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    reasons = [ln[2:] for ln in lines if ln.startswith("- ")]
    return _one_line(reasons[0] if reasons else lines[0] if lines else type(exc).__name__) + (
        f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
    )


def _unbuilt(arch: str, vlm: bool, e: ImportError) -> str:
    """The refusal of a tiny model whose classes need a package not installed: the backend's own
    refusal of its config.json (the one `mbr check` gives, its config's blockers first), which
    names that package where nothing else stops it."""
    hf = tiny_config(arch).to_dict()
    if vlm:  # run as its VLM class, as save_pretrained's `architectures` would say
        hf["architectures"] = [image_text_class_name(hf["model_type"])]
    try:
        TransformersBackend().table(describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers"))
    except UserError as r:
        return refusal(r)
    return str(needs_package(arch, e))  # described without the package: the builder's import is still its refusal


def prepare(arch: str, root: Path, layouts: Sequence[str], vlm: bool = False) -> dict[str, str]:
    """Build `arch`'s tiny model (`vlm`: as its VLM class) and its reference under root/arch;
    {layout: refusal} for the layouts the backend refuses ({"*": reason} when it refuses the model)."""

    hf_dir = root / arch
    try:
        make_tiny(arch, hf_dir, image_text=True if vlm else None)
    except ImportError as e:  # a package its classes need is not installed: a refusal, not this matrix's FAIL
        return {"*": _unbuilt(arch, vlm, e)}
    except Exception as e:  # the survey's builder: its own refusals and failures
        return {"*": f"FAIL: tiny model not built: {_one_line(f'{type(e).__name__}: {e}')}"}
    hf = read_hf_config(hf_dir)
    try:
        spec = describe_hf(hf, make_vocab_size_divisible_by=8, backend="transformers")
        TransformersBackend().table(spec)  # the checkpoint names: a tensor transformers converts is refused here
    except UserError as e:
        return {"*": refusal(e)}
    except Exception as e:  # not a refusal: a row, never a traceback that ends the matrix
        return {"*": f"FAIL: describe: {_one_line(f'{type(e).__name__}: {e}', 160)}"}
    out = {}
    for text in layouts:
        if Layout.parse(text).ep > 1 and not spec.is_moe:
            out[text] = NOT_MOE
            continue
        limits = TransformersBackend().layout_limits(spec, Layout.parse(text))
        if limits:
            out[text] = "; ".join(_one_line(w) for w, _ in limits)
    if len(out) < len(layouts):
        try:
            if vlm:
                ref = image_reference(hf_dir, 2, 32, 0)
            else:
                ids, labels = make_batch(spec.vocab_size)
                ref = dict(input_ids=ids, labels=labels, **hf_reference(hf_dir, ids, labels))
                ref["grad_floor"] = grad_floor(hf_dir, ids, labels, ref["grads"])
        except Exception as e:
            return {"*": f"FAIL: transformers' reference: {_one_line(f'{type(e).__name__}: {e}', 160)}"}
        torch.save(ref, root / f"{arch}.ref.pt")
    return out


def _widest(spec: Any) -> str | None:
    """The first of PER_RANK the backend builds this model at (its `layout_limits`; ep for MoE)."""
    for text in PER_RANK:
        lay = Layout.parse(text)
        if (lay.ep > 1 and not spec.is_moe) or spec.num_layers < lay.pp or spec.num_attention_heads % lay.tp:
            continue
        if not TransformersBackend().layout_limits(spec, lay):
            return text
    return None


def _quiet(argv: list[str]) -> str:
    """`mbr ARGV...` in this process, its output captured: "" on success, else its last line."""
    from megatron_bridge.cli import main as mbr  # the commands themselves, as a user runs them

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = mbr(argv)
        except Exception as e:  # not a refusal: the round trip's FAIL, never one that ends the matrix
            return _one_line(f"{type(e).__name__}: {e}", 160)
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    return "" if code == 0 else _one_line(lines[-1] if lines else f"exit {code}", 200)


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def _difference(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> str:
    """The first way `got` is not `want` (names, dtype, shape, bytes), "" when it is."""
    if want.keys() != got.keys():
        return f"names differ: {sorted(set(want) ^ set(got))[:3]}"
    for k, a in want.items():
        b = got[k]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return f"{k}: {a.dtype} {list(a.shape)} came back as {b.dtype} {list(b.shape)}"
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            return f"{k}: other bytes"
    return ""


def convert_round_trip(hf_dir: Path, spec: Any, root: Path) -> str:
    """`mbr convert` to torch_dist and to per-rank files at the widest layout the backend allows
    (`_widest`), `mbr export` of each: every source tensor back bit for bit, or the first failure."""
    want, done = _tensors(hf_dir), []
    widest = _widest(spec)
    for fmt, text in (("torch_dist", None), ("torch", widest)):
        if fmt == "torch" and text is None:
            continue
        lay = Layout.parse(text) if text else Layout()
        ck, ex = root / "rt" / f"{hf_dir.name}-{fmt}", root / "rt" / f"{hf_dir.name}-{fmt}-hf"
        degrees = [f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.ep={lay.ep}"]
        common = ["overwrite=true", "progress=off"]
        err = _quiet(
            ["convert", f"src={hf_dir}", f"dst={ck}", f"format={fmt}", "model.backend=transformers", *degrees, *common]
        )
        if err:
            return f"FAIL: convert to {fmt}: {err}"
        err = _quiet(["export", f"src={ck}", f"dst={ex}", *common])
        if err:
            return f"FAIL: export from {fmt}: {err}"
        diff = _difference(want, _tensors(ex))
        if diff:
            return f"FAIL: {fmt}: {_one_line(diff, 160)}"
        shutil.rmtree(ck, ignore_errors=True)
        shutil.rmtree(ex, ignore_errors=True)
        done.append(fmt if text is None else f"torch {text}")
    return f"{CONVERT_OK} ({len(want)} tensors; {', '.join(done)})"


def grad_floor(
    hf_dir: Path, ids: torch.Tensor, labels: torch.Tensor, grads: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Per HF tensor, how far transformers' own fp32 gradient is from its fp64 one (max-abs):
    the rounding floor of that tensor on this tiny model. A split summed in another order lands
    anywhere within it, so the verdict allows it on top of `1e-5 + 1e-5·|ref|` (parity's
    `_compare_dict`); where fp32 is well conditioned it is ~1e-7 and changes nothing. A model
    transformers cannot run in fp64 gets no floor (the plain verdict)."""
    try:
        exact = hf_reference(hf_dir, ids, labels, dtype=torch.float64)["grads"]
    except Exception:  # an fp32-only kernel: no floor, not a row of its own
        return {}
    return {k: float((g.double() - exact[k]).abs().max()) for k, g in grads.items() if k in exact and g.numel()}


def worker(argv: Sequence[str]) -> None:
    """Inside torchrun: every (layout, architecture) of the group; each rank reports its
    findings, or the exception that stopped it, under "<arch>/<layout>"."""
    opts = dict(zip(argv[::2], argv[1::2], strict=True))  # --root R --archs A,B --layouts JSON (from _launch)

    root = Path(opts["--root"])
    todo = json.loads(opts["--layouts"])  # {arch: [layouts]}
    for text in ACCEPTED:
        for arch in opts["--archs"].split(","):
            if text not in todo.get(arch, []):
                continue
            ref = torch.load(root / f"{arch}.ref.pt", weights_only=True)
            t0 = time.perf_counter()
            try:
                res = check_layout(root / arch, Layout.parse(text), list(CHECKS), ref=ref,
                                   input_ids=ref["input_ids"], labels=ref["labels"], images=ref.get("images"),
                                   export_dir=root / "out" / arch / text, backend="transformers")  # fmt: skip
            except UserError as e:  # a refusal met while building: its one line
                res = {"refused": refusal(e)}
            except Exception as e:
                tb = traceback.extract_tb(e.__traceback__)
                where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
                res = {"error": _one_line(f"{type(e).__name__}: {e}", 160) + where}
                # the other ranks may be waiting on this one (a pipeline stage's send): going on
                # would pair the next layout's collectives with theirs and hang the launch, so end
                # it now; the launcher reads this line back (`_launch`)
                print(f"{ERROR_MARK}{arch}/{text}: {res['error']}", flush=True)
                os._exit(1)
            res["seconds"] = round(time.perf_counter() - t0, 3)
            report({f"{arch}/{text}": res})
    torch.distributed.barrier()


def _row(arch: str, text: str, per_rank: list[dict[str, Any]], ref: dict[str, Any], tol: float, conv: str) -> str:
    """One layout's row; `conv` is the architecture's checkpoint round trip (`convert_round_trip`),
    which a passing row needs too."""
    key = f"{arch}/{text}"
    errors = [r[key]["error"] for r in per_rank if key in r and "error" in r[key]]
    if errors:
        return f"| {arch} | {text} | - | - | - | - | {conv} | FAIL: {errors[0]} |"
    refused = [r[key]["refused"] for r in per_rank if key in r and "refused" in r[key]]
    if refused:
        return f"| {arch} | {text} | - | - | - | - | {conv} | refused: {refused[0]} |"
    f = fold(per_rank, key, ref)
    if f is None:
        return f"| {arch} | {text} | - | - | - | - | {conv} | FAIL: no rank reported |"
    nan = float("nan")
    ok = f.get("logits_max", nan) <= tol and f.get("loss_delta", nan) <= tol
    ok &= grads_pass(f, tol)
    ok &= bool(f.get("rt_ok")) and f.get("rt_n") == f.get("grads_want")
    grads = f"{f.get('grads_max', nan):.1e} ({f.get('grads_n', 0)}/{f.get('grads_want', 0)})"
    rt = f"{f['rt_n']} bit-exact" if f.get("rt_ok") else f"FAIL {str(f.get('rt_bad', ''))[:60]}"
    why = "" if ok else f" {str(f.get('grads_bad') or '')[:80]}"
    verdict = "pass" if ok and conv.startswith(CONVERT_OK) else "FAIL" + (why if not ok else " (convert ⇄ export)")
    return (
        f"| {arch} | {text} | {f.get('logits_max', nan):.1e} | {f.get('loss_delta', nan):.1e} | {grads} | {rt} "
        f"| {conv} | {verdict} |"
    )


def _launch(root: Path, todo: dict[str, list[str]], timeout: float) -> tuple[list[dict[str, Any]], str]:
    args = ["-m", "megatron_bridge.commands.verify_matrix_transformers", "--worker", "--root", str(root),
            "--archs", ",".join(todo), "--layouts", json.dumps(todo)]  # fmt: skip
    try:
        return run_torchrun(args, nproc=NPROC, timeout=timeout, expect_results=False), ""
    except TorchrunError as e:
        errors = [ln.split(ERROR_MARK, 1)[1] for ln in e.output.splitlines() if ERROR_MARK in ln]
        if errors:  # a rank's exception ended the launch (`worker`)
            return [], _one_line(errors[0], 240)
        first = str(e).strip().splitlines()[0] if str(e).strip() else "?"
        return [], _one_line(first.split(" (nproc=")[-1], 120)


def run_matrix(
    archs: Sequence[str],
    layouts: Sequence[str],
    root: Path,
    *,
    tol: float,
    timeout: float,
    echo=print,
    vlm: bool = False,
) -> dict[str, int]:
    """Print the table; return the counts of pass / refused / FAIL rows."""

    t0 = time.perf_counter()
    echo(HEADER if layouts else CONVERT_HEADER)
    echo("|" + "---|" * (8 if layouts else 3))
    rows: dict[tuple[str, str], str] = {}
    todo: dict[str, list[str]] = {}
    conv: dict[str, str] = {}
    for arch in archs:
        refused = prepare(arch, root, layouts, vlm)
        if "*" in refused:
            verdict = refused["*"] if refused["*"].startswith("FAIL") else f"refused: {refused['*']}"
            rows[arch, "*"] = (
                f"| {arch} | all | - | - | - | - | - | {verdict} |" if layouts else f"| {arch} | - | {verdict} |"
            )
            continue
        spec = describe_hf(read_hf_config(root / arch), make_vocab_size_divisible_by=8, backend="transformers")
        conv[arch] = convert_round_trip(root / arch, spec, root)
        if not layouts:  # `verify.checks=[convert]`: the checkpoint round trip alone
            ok = conv[arch].startswith(CONVERT_OK)
            rows[arch, "*"] = f"| {arch} | {conv[arch]} | {'pass' if ok else 'FAIL'} |"
            continue
        for text in layouts:
            if text in refused and refused[text] != NOT_MOE:
                rows[arch, text] = f"| {arch} | {text} | - | - | - | - | {conv[arch]} | refused: {refused[text]} |"
        if runs := [t for t in layouts if t not in refused]:  # none: every layout refused or n/a (no reference made)
            todo[arch] = runs
    names = list(todo)
    for i in range(0, len(names), GROUP):
        group = {a: todo[a] for a in names[i : i + GROUP]}
        per_rank, failure = _launch(root, group, timeout)
        if failure:  # a crash or hang loses the group's reports: each alone, once
            per_rank = [{} for _ in range(NPROC)]
            for a in group:
                alone, why = _launch(root, {a: group[a]}, timeout / 4)
                per_rank = [{**r, **s} for r, s in zip(per_rank, alone or [{}] * NPROC, strict=True)]
                for t in group[a] if why else ():
                    rows[a, t] = f"| {a} | {t} | - | - | - | - | {conv[a]} | FAIL: launch failed ({why}) |"
        for a in group:
            ref = torch.load(root / f"{a}.ref.pt", weights_only=True)
            for t in group[a]:
                rows.setdefault((a, t), _row(a, t, per_rank, ref, tol, conv[a]))
    counts = {"pass": 0, "refused": 0, "FAIL": 0}
    for arch in archs:
        for t in ("*", *layouts):
            if (arch, t) in rows:
                row = rows[arch, t]
                echo(row)
                verdict = row.rsplit("|", 2)[-2].strip()
                counts["pass" if verdict == "pass" else "refused" if verdict.startswith("refused") else "FAIL"] += 1
    echo("")
    echo(
        f"{len(archs)} architectures: "
        + ", ".join(f"{v} {k}" for k, v in counts.items())
        + f" rows; {time.perf_counter() - t0:.0f} s"
    )
    return counts


def main(argv: Sequence[str]) -> int:
    """`mbr verify --matrix model.backend=transformers [verify.families=[...]] [verify.layouts=[...]]`."""

    argv = [a for a in argv if a != "--matrix"]
    cfg, _ = parse_command(argv, VerifyConfig, doc=__doc__)
    vlm = cfg.verify.vlm
    known = vlm_architectures() if vlm else architectures()
    archs = list(cfg.verify.families) or known
    unknown = [a for a in archs if a not in known]
    if unknown:
        what = "image-text-to-text types whose language model has" if vlm else "causal-LM architectures with"
        raise UserError(f"verify.families {unknown}: not {what} a tp plan ({len(known)} are)")
    convert_only = list(cfg.verify.checks) == ["convert"]  # the offline round trips alone: no launches
    layouts = [] if convert_only else [x.replace("·", "") for x in (cfg.verify.layouts or LAYOUTS)]
    bad = [x for x in layouts if x not in ACCEPTED]
    if bad:
        raise UserError(
            f"verify.layouts {bad}: the transformers matrix runs {', '.join(ACCEPTED)} (ep2, ep2tp2sp: MoE models only)"
        )
    with tempfile.TemporaryDirectory(prefix="mbr-hf-matrix-") as tmp:
        root = Path(cfg.verify.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        counts = run_matrix(archs, layouts, root, tol=TOL, timeout=min(cfg.verify.timeout_s, 480.0), vlm=vlm)
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2:])
