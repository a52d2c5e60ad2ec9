"""The GPU kit's shapes, its subprocess runner and parsers, and its checks that are training runs
of their own (resume, the fp8 loss curve, all 32 layers of the 8B shape): benchmarks/gpu/kit.py
runs them; kept apart so the kit's list of checks stays readable."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Llama-3-8B layers (h 4096, ffn 14336, 32/8 heads, vocab 128,256, seq 8192), 8 of them with Adam
LLAMA8B = ["--hidden", "4096", "--ffn", "14336", "--heads", "32", "--kv", "8", "--vocab", "128256"]
LLAMA8B += ["--seq", "8192", "--layers", "8", "--gbs", "8", "--steps", "12", "--recompute", "full"]
LLAMA8B_SMOKE = ["--hidden", "64", "--ffn", "224", "--heads", "4", "--kv", "2", "--vocab", "1024"]
LLAMA8B_SMOKE += ["--seq", "64", "--layers", "1", "--gbs", "2", "--steps", "10", "--recompute", "full"]
# Qwen3-30B-A3B layers (h 2048, 32/4 heads of dim 128, 128 experts top-8 of ffn 768, vocab 151,936)
QWEN3_MOE = ["--hidden", "2048", "--heads", "32", "--kv", "4", "--head-dim", "128", "--vocab", "151936"]
QWEN3_MOE += ["--experts", "128", "--topk", "8", "--moe-ffn", "768", "--ffn", "6144"]
QWEN3_MOE += ["--seq", "4096", "--layers", "4", "--gbs", "8", "--steps", "10", "--recompute", "full"]
QWEN3_MOE_SMOKE = ["--hidden", "64", "--heads", "4", "--kv", "2", "--head-dim", "32", "--vocab", "1024"]
QWEN3_MOE_SMOKE += ["--experts", "8", "--topk", "2", "--moe-ffn", "32", "--ffn", "128"]
QWEN3_MOE_SMOKE += ["--seq", "64", "--layers", "1", "--gbs", "2", "--steps", "10", "--recompute", "full"]
H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM, the MFU denominator


def run(name: str, cmd: list[str], timeout: int, log: Path) -> tuple[int, str, float]:
    """Run one check; its whole output goes to `log/name.log`, the tail comes back."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # no progress bars in the tails
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"{e.stdout or ''}{e.stderr or ''}\n[timed out after {timeout} s]"
        text = text if isinstance(text, str) else str(text)
    (log / f"{name}.log").write_text(text)
    return rc, text, time.time() - t0


def model_tflops(shape: list[str], step_ms: float) -> float:
    """Model TFLOP/s of a train_overhead.py shape at `step_ms` per step: 6 x the GEMM parameters a
    token meets (attention with its KV groups, a SwiGLU FFN — an MoE's top-k experts and its
    router —, the LM head) per token, plus causal attention's 12 x layers x heads x head dim x seq
    per token (not halved: the usual convention)."""
    a = dict(zip(shape[::2], shape[1::2], strict=False))
    h, layers, seq, gbs = (int(a[k]) for k in ("--hidden", "--layers", "--seq", "--gbs"))
    heads = int(a.get("--heads", 8))
    kv, ffn, vocab = int(a.get("--kv", heads // 2)), int(a.get("--ffn", 4 * h)), int(a.get("--vocab", 512))
    hd = int(a.get("--head-dim", h // heads))
    experts = int(a.get("--experts", 0))
    mlp = 3 * h * ffn
    if experts:
        mlp = int(a.get("--topk", 2)) * 3 * h * int(a.get("--moe-ffn", ffn)) + h * experts
    gemm = layers * (2 * h * heads * hd + 2 * h * kv * hd + mlp) + vocab * h
    tokens = seq * gbs
    return (6 * gemm * tokens + 12 * layers * heads * hd * seq * tokens) / (step_ms / 1e3) / 1e12


def mfu_line(shape: list[str], text: str) -> str:
    """Ours and the bare loop's tokens/s, model TFLOP/s and MFU, from train_overhead.py's output."""
    out = []
    for who, pat in (("ours", r"megatron_bridge\.train"), ("bare", r"bare megatron-core loop")):
        step = float(re.search(pat + r"\s+median step\s+([\d.]+) ms", text).group(1))
        a = dict(zip(shape[::2], shape[1::2], strict=False))
        tok = int(a["--seq"]) * int(a["--gbs"]) / (step / 1e3)
        tf = model_tflops(shape, step)
        out.append(f"{who} {tok:,.0f} tokens/s, {tf:.3g} model TFLOP/s, MFU {tf / H100_BF16_TFLOPS:.1%}")
    return "; ".join(out) + " (of H100 bf16 dense peak)"


def tokens_per_s(shape: list[str], text: str) -> float:
    a = dict(zip(shape[::2], shape[1::2], strict=False))
    step = float(re.search(r"megatron_bridge\.train\s+median step\s+([\d.]+) ms", text).group(1))
    return int(a["--seq"]) * int(a["--gbs"]) / (step / 1e3)


def full_8b(log: Path, report: list[str], smoke: bool) -> None:
    """All 32 Llama-3-8B layers on the one GPU, if they fit: ours alone (megatron engine, full
    recompute, compiled and fused, the loss 1024 positions at a time), tokens/s and MFU."""
    shape = [*LLAMA8B[: LLAMA8B.index("--layers")], "--layers", "32", "--gbs", "8", "--steps", "8"]
    if smoke:
        shape = [*LLAMA8B_SMOKE[: LLAMA8B_SMOKE.index("--layers")], "--layers", "2", "--gbs", "2", "--steps", "4"]
    a = dict(zip(shape[::2], shape[1::2], strict=False))
    model = [f"model.num_layers={a['--layers']}", f"model.hidden_size={a['--hidden']}"]
    model += [f"model.ffn_hidden_size={a['--ffn']}", f"model.num_attention_heads={a['--heads']}"]
    model += [f"model.num_query_groups={a['--kv']}", f"model.vocab_size={a['--vocab']}"]
    with tempfile.TemporaryDirectory(prefix="kit-8b-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "megatron_bridge.train"]
        cmd += ["recipe=default", "parallel.tp=1", "cluster.gpus_per_node=1", *model, f"train.steps={a['--steps']}"]
        cmd += [f"train.seq_length={a['--seq']}", f"model.max_position_embeddings={a['--seq']}"]
        cmd += ["train.micro_batch_size=1", f"train.global_batch_size={a['--gbs']}", "optimizer.warmup_steps=1"]
        cmd += ["train.recompute=full", f"train.compile={str(not smoke).lower()}", "train.fused=true"]
        cmd += [f"run_dir={tmp}/run"]
        cmd += [f"train.loss_chunk={min(1024, int(a['--seq']))}"]
        rc, text, secs = run("llama8b_32", cmd, 540, log)
        if rc:
            report.append(f"- llama8b_32 ({' '.join(shape)}): rc={rc} in {secs:.0f} s\n```\n{tail(text, 12)}\n```")
            return
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    times = sorted(r["step_time"] for r in rows[1:])  # the first step compiles
    step_ms = times[len(times) // 2] * 1e3
    tf = model_tflops(shape, step_ms)
    tok = int(a["--seq"]) * int(a["--gbs"]) / (step_ms / 1e3)
    report.append(
        f"- llama8b_32 ({' '.join(shape)}; {'' if smoke else 'compiled, '}fused, loss_chunk): median step {step_ms:.0f} ms, "
        f"{tok:,.0f} tokens/s, {tf:.3g} model TFLOP/s, MFU {tf / H100_BF16_TFLOPS:.1%}"
    )


def fp8_curve(log: Path, report: list[str], smoke: bool) -> None:
    """`train.precision=fp8` against bf16 over 200 steps of a ~0.4B Llama on the same synthetic
    batches: the largest relative difference of a step's loss, and of the mean of the last 50."""
    model = ["model.num_layers=12", "model.hidden_size=1536", "model.ffn_hidden_size=4096"]
    model += ["model.num_attention_heads=12", "model.num_query_groups=4", "model.vocab_size=32000"]
    steps, seq, gbs = (200, 2048, 8) if not smoke else (10, 64, 2)
    if smoke:
        model = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128"]
        model += ["model.num_attention_heads=4", "model.num_query_groups=2", "model.vocab_size=512"]
    losses = {}
    with tempfile.TemporaryDirectory(prefix="kit-fp8-") as tmp:
        for precision in ("bf16", "fp8"):
            run_dir = Path(tmp) / precision
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "megatron_bridge.train"]
            cmd += ["recipe=default", "parallel.tp=1", "cluster.gpus_per_node=1", *model, f"train.steps={steps}"]
            cmd += [f"train.seq_length={seq}", f"model.max_position_embeddings={seq}", "train.micro_batch_size=1"]
            cmd += [f"train.global_batch_size={gbs}", "optimizer.warmup_steps=10", f"run_dir={run_dir}"]
            cmd += [f"train.precision={precision if not smoke or precision == 'fp8' else 'fp32'}"]
            rc, text, secs = run(f"fp8_curve_{precision}", cmd, 420, log)
            if rc:
                report.append(f"- fp8 curve/{precision}: FAILED rc={rc} after {secs:.0f} s\n```\n{tail(text)}\n```")
                return
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            losses[precision] = [r["loss"] for r in rows if "loss" in r]
    ref, got = losses["bf16"], losses["fp8"]
    worst = max(abs(g - r) / abs(r) for r, g in zip(ref, got, strict=True))
    tail50 = abs(sum(got[-50:]) - sum(ref[-50:])) / abs(sum(ref[-50:]))
    report.append(
        f"- fp8 curve ({len(ref)} steps, {' '.join(model)}, seq {seq}, gbs {gbs}): largest step |diff| "
        f"{worst:.2%}, last-50 mean {tail50:.2%} (goal <= 1%); loss {ref[0]:.3f} -> bf16 {ref[-1]:.3f}, fp8 {got[-1]:.3f}"
    )


def tail(text: str, n: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def resume_check(log: Path, report: list[str], check: str = "resume", engine: tuple[str, ...] = ()) -> None:
    with tempfile.TemporaryDirectory(prefix="kit-resume-") as tmp:
        common = [
            "recipe=tiny_llama", "parallel.tp=1", "parallel.pp=1", "cluster.gpus_per_node=1",
            "checkpoint.save_interval=3", "optimizer.warmup_steps=1", *engine,
        ]  # fmt: skip
        losses = {}
        for name, extra in (
            ("full", ["train.steps=6"]),
            ("first3", ["train.steps=6", "train.exit_after=3"]),
            ("resumed", ["train.steps=6", "checkpoint.resume=true"]),
        ):
            run_dir = Path(tmp) / name
            ck = [f"checkpoint.dir={tmp}/ck_{'full' if name == 'full' else 'part'}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "megatron_bridge.train"]
            rc, text, secs = run(f"{check}_{name}", [*cmd, *common, *ck, *extra, f"run_dir={run_dir}"], 150, log)
            if rc:
                report.append(f"- {check}/{name}: FAILED rc={rc} after {secs:.0f} s\n```\n{tail(text)}\n```")
                return
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            losses[name] = {r["step"]: r["loss"] for r in rows if "loss" in r}
        steps = sorted(losses["resumed"])
        diffs = [abs(losses["full"][s] - losses["resumed"][s]) for s in steps]
        report.append(
            f"- {check}: steps {steps} full={[losses['full'][s] for s in steps]} "
            f"resumed={[losses['resumed'][s] for s in steps]} max |diff| = {max(diffs):.3g}"
            f"{' (bit-exact)' if max(diffs) == 0 else ''}"
        )
