"""Peak memory of `train.loss_chunk` against the whole-sequence LM head and cross entropy.

Two single-process training runs of the same model (a 2-layer h 256 Llama shape with a large
vocabulary, so the logits dominate the activations), fp32 on CPU, identical but for
`train.loss_chunk`; each run's peak resident memory (the kernel's `ru_maxrss` of that process)
and their difference, beside the size of one micro-batch's fp32 logits (seq x vocab x 4 bytes).

    .venv/bin/python benchmarks/loss_chunk_memory.py [--vocab 65536] [--seq 2048] [--chunk 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def peak_rss_mib(a: argparse.Namespace, chunk: int) -> tuple[float, list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [
            sys.executable, "-m", "megatron_bridge.train", "recipe=default", "parallel.dp=1", "data=synthetic",
            "model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=1024",
            "model.num_attention_heads=4", "model.num_query_groups=2", f"model.vocab_size={a.vocab}",
            f"model.max_position_embeddings={a.seq}", f"train.seq_length={a.seq}", "train.micro_batch_size=1",
            "train.global_batch_size=1", f"train.steps={a.steps}", "optimizer.warmup_steps=1",
            "logger.tensorboard.enabled=false", f"train.loss_chunk={chunk}", f"run_dir={run_dir}",
        ]  # fmt: skip
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        _, status, usage = os.wait4(p.pid, 0)
        err = p.stderr.read() if p.stderr else ""
        if status:
            sys.exit(f"run failed (loss_chunk={chunk}):\n{err[-3000:]}")
        rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return usage.ru_maxrss / 1024, [r["loss"] for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    whole, losses_whole = peak_rss_mib(a, 0)
    chunked, losses_chunked = peak_rss_mib(a, a.chunk)
    logits = a.seq * a.vocab * 4 / 2**20
    print(f"vocab {a.vocab}, seq {a.seq}, micro-batch 1, fp32; one micro-batch's logits: {logits:.0f} MiB")
    print(f"  whole sequence       peak RSS {whole:8.0f} MiB")
    print(f"  loss_chunk={a.chunk:<8d} peak RSS {chunked:8.0f} MiB")
    print(f"  saved: {whole - chunked:.0f} MiB ({(whole - chunked) / logits:.1f}x the logits)")
    same = all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(losses_whole, losses_chunked, strict=True))
    print(f"  losses {'equal within 1e-5' if same else 'DIFFER'}: {losses_whole} vs {losses_chunked}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
