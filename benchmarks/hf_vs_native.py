"""Step time of the transformers backend against the native one on the same Llama.

One script, both runs: a random Llama is saved with transformers (`save_pretrained`), then
`python -m megatron_bridge.train model.hf_path=DIR` trains it under `model.backend=native`
and under `model.backend=transformers`, same layout, batch and synthetic data, one torchrun launch each.
It prints the median step time of each (steps after the first third), their ratio (goal
<= 1.25) and, on a GPU, model TFLOP/s and MFU of each.

    .venv/bin/python benchmarks/hf_vs_native.py --tp 2            # CPU, 2 processes
    .venv/bin/python benchmarks/hf_vs_native.py --tp 2 --pp 2     # 4 processes
    python3 benchmarks/hf_vs_native.py --tp 1 --hidden 2048 --layers 16 --seq 2048 --gbs 16  # GPU kit
    python3 benchmarks/hf_vs_native.py ... train.compile=true train.fused=true   # any train overrides, both runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = 989.0  # dense bf16 of an H100/H200 SXM: the MFU denominator on a GPU


def save_llama(path: Path, a: argparse.Namespace, cuda: bool) -> int:
    """A random Llama of the requested shape in `path`; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=a.hidden,
        intermediate_size=a.ffn or 4 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv or a.heads // 2,
        vocab_size=a.vocab,
        max_position_embeddings=a.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if cuda else torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def train(backend: str, hf: Path, a: argparse.Namespace, nproc: int) -> tuple[list[float], float]:
    """Step times of one `megatron_bridge.train` launch, and seconds from launch to step 1."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore",
           "WANDB_MODE": "disabled"}  # fmt: skip
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            "recipe=default", f"model.hf_path={hf}", f"model.backend={backend}", "data=synthetic",
            f"parallel.tp={a.tp}", f"parallel.pp={a.pp}", f"cluster.gpus_per_node={nproc}",
            f"train.seq_length={a.seq}", "train.micro_batch_size=1", f"train.global_batch_size={a.gbs}",
            f"train.steps={a.steps}", "optimizer.warmup_steps=1", "optimizer.weight_decay=0.0",
            "logger.tensorboard.enabled=false", f"train.recompute={a.recompute}",
            f"run_dir={run_dir}", *a.overrides,
        ]  # fmt: skip
        t0 = time.time()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "-m",
            "megatron_bridge.train",
        ]
        out = subprocess.run([*cmd, *overrides], capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
        if out.returncode:
            sys.exit(f"{backend} run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    return [r["step_time"] for r in rows], rows[0]["time"] - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--kv", type=int, default=0, help="KV heads (0: heads / 2)")
    ap.add_argument("--ffn", type=int, default=0, help="FFN hidden size (0: 4 x hidden)")
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    ap.add_argument("overrides", nargs="*", help="more megatron_bridge.train overrides, for both runs")
    a = ap.parse_args()
    import torch

    cuda = torch.cuda.is_available()
    nproc = a.tp * a.pp
    skip = max(1, a.steps // 3)
    with tempfile.TemporaryDirectory() as tmp:
        params = save_llama(Path(tmp) / "llama", a, cuda)
        runs = {b: train(b, Path(tmp) / "llama", a, nproc) for b in ("native", "transformers")}
    print(f"Llama h={a.hidden} L={a.layers} seq={a.seq} gbs={a.gbs} tp={a.tp} pp={a.pp} ({params / 1e6:.1f} M params), "
          f"{a.steps} steps, median of steps > {skip}, {'GPU bf16' if cuda else 'CPU fp32'} "
          f"recompute={a.recompute} {' '.join(a.overrides)}")  # fmt: skip
    med = {}
    for b, (times, first) in runs.items():
        med[b] = statistics.median(times[skip:])
        line = f"  {b:<7} median step {med[b] * 1e3:9.1f} ms   first step done {first:6.1f} s after launch"
        if cuda:  # 6·N·tokens for the matmuls plus the attention scores, forward and backward
            flops = 6 * params * a.seq * a.gbs + 12 * a.layers * a.hidden * a.seq * a.seq * a.gbs
            tflops = flops / med[b] / 1e12 / nproc
            line += f"   {tflops:6.1f} TFLOP/s per GPU, MFU {tflops / PEAK_TFLOPS:.1%}"
        print(line)
    print(f"  step time ratio (transformers / native): {med['transformers'] / med['native']:.3f}  (goal <= 1.25)")


if __name__ == "__main__":
    main()
