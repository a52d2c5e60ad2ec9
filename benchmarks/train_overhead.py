"""Overhead of `python -m megatron_bridge.train` over a bare megatron-core loop.

Runs, in one script, the same model shape / layout / batch under both (each as its own
torchrun launch, one after the other) and prints the median step time of each, their
ratio (goal ≤ 1.03) and the time to the first finished step from launch (startup:
imports, Hydra compose, validation, groups, model build).

    .venv/bin/python benchmarks/train_overhead.py [--tp 2] [--steps 30] [--hidden 256]
"""

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


def launch(args, nproc):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "disabled",
    }
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=1200,
    )
    if out.returncode:
        sys.exit(f"launch failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return t0, out.stdout


def rows_from(text):
    return [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]


def summary(name, t0, rows, skip):
    times = [r["step_time"] for r in rows[skip:]]
    return {"name": name, "median_step_s": statistics.median(times), "first_step_after_launch_s": rows[0]["time"] - t0}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8, help="query heads (half as many KV groups)")
    ap.add_argument("--kv", type=int, default=0, help="KV groups (0: heads / 2)")
    ap.add_argument("--ffn", type=int, default=0, help="FFN hidden size (0: 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--recompute", default="none", choices=("none", "full"))
    ap.add_argument("--compile", action="store_true", help="both runs with torch.compile of every layer")
    ap.add_argument("--fp8", default="", choices=("", "tensorwise", "rowwise"), help="both runs with float8 GEMMs")
    ap.add_argument("--fused", action="store_true", help="both runs with megatron-core's fused kernels")
    ap.add_argument("--head-dim", type=int, default=0, help="attention head dim (0: hidden / heads)")
    ap.add_argument("--experts", type=int, default=0, help="MoE experts per layer (0: dense)")
    ap.add_argument("--topk", type=int, default=2, help="MoE experts per token")
    ap.add_argument("--moe-ffn", type=int, default=0, help="an expert's FFN hidden size (0: --ffn)")
    a = ap.parse_args()
    kv, ffn = a.kv or a.heads // 2, a.ffn or 4 * a.hidden
    skip = min(5, a.steps // 3)
    t0, out = launch(
        [
            "benchmarks/bare_megatron_loop.py",
            *(f"--{k}={getattr(a, k)}" for k in ("tp", "steps", "hidden", "layers", "seq", "gbs", "heads", "vocab")),
            f"--kv={kv}",
            f"--ffn={ffn}",
            f"--recompute={a.recompute}",
            *(["--compile"] if a.compile else []),
            *([f"--fp8={a.fp8}"] if a.fp8 else []),
            *(["--fused"] if a.fused else []),
            f"--head-dim={a.head_dim}",
            *([f"--experts={a.experts}", f"--topk={a.topk}", f"--moe-ffn={a.moe_ffn or ffn}"] if a.experts else []),
        ],
        a.tp,
    )
    bare = summary("bare megatron-core loop", t0, rows_from(out), skip)
    with tempfile.TemporaryDirectory() as run_dir:
        ovr = [
            "recipe=default",
            f"parallel.tp={a.tp}",
            f"cluster.gpus_per_node={a.tp}",
            f"model.num_layers={a.layers}",
            f"model.hidden_size={a.hidden}",
            f"model.ffn_hidden_size={ffn}",
            f"model.num_attention_heads={a.heads}",
            f"model.num_query_groups={kv}",
            f"model.vocab_size={a.vocab}",
            f"model.max_position_embeddings={a.seq}",
            f"train.seq_length={a.seq}",
            "train.micro_batch_size=1",
            f"train.global_batch_size={a.gbs}",
            f"train.steps={a.steps}",
            "optimizer.weight_decay=0.0",
            f"run_dir={run_dir}",
            f"train.compile={str(a.compile).lower()}",
            f"train.recompute={a.recompute}",
            *(["train.precision=fp8", f"train.fp8_recipe={a.fp8}"] if a.fp8 else []),
            f"train.fused={str(a.fused).lower()}",
            *([f"model.kv_channels={a.head_dim}"] if a.head_dim else []),
            *(
                [f"model.num_moe_experts={a.experts}", f"model.moe_router_topk={a.topk}"]
                + [f"model.moe_ffn_hidden_size={a.moe_ffn or ffn}"]
                if a.experts
                else []
            ),
        ]
        t0, _ = launch(["-m", "megatron_bridge.train", *ovr], a.tp)
        rows = [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    ours = summary("megatron_bridge.train", t0, rows, skip)
    print(
        f"model h={a.hidden} L={a.layers} heads={a.heads}/{kv} kv (head dim {a.head_dim or a.hidden // a.heads}) "
        f"{f'experts={a.experts} top-{a.topk} moe_ffn={a.moe_ffn or ffn}' if a.experts else f'ffn={ffn}'} "
        f"vocab={a.vocab} seq={a.seq} gbs={a.gbs} recompute={a.recompute} "
        f"tp={a.tp}, {a.steps} steps (median of steps > {skip}){', both compiled' if a.compile else ''}"
        f"{', both fused' if a.fused else ''}{f', both fp8 ({a.fp8})' if a.fp8 else ''}"
    )
    for r in (bare, ours):
        print(
            f"  {r['name']:<26} median step {r['median_step_s'] * 1e3:8.1f} ms   first step done "
            f"{r['first_step_after_launch_s']:6.1f} s after launch"
        )
    print(f"  step time ratio (ours / bare): {ours['median_step_s'] / bare['median_step_s']:.3f}  (goal <= 1.03)")
    print(
        f"  startup ratio   (ours / bare): {ours['first_step_after_launch_s'] / bare['first_step_after_launch_s']:.2f}"
    )


if __name__ == "__main__":
    main()
