"""What a checkpoint save or an interval HF export costs the training loop, in the step against
behind the loop (`checkpoint.async_save`, `train.export_buffer_bytes`).

Five single-process launches of the same run (a ~25 M-parameter Llama shape, fp32 + Adam:
~0.3 GB per checkpoint, ~0.1 GB per HF export): nothing saved, a save every `--every` steps,
the same with `checkpoint.async_save=true`, an HF export every `--every` steps written in the
step (`train.export_buffer_bytes=0`) and the same behind the loop (the default buffer). The
loop's time is the span between the first and the last step's metrics line (the saves happen in
between); the script prints each, the stall per save (its extra time over the first run,
divided by the number of saves) and that stall as a share of the whole loop's step time, and
what the metrics say the training thread spent per save: the snapshot, and the waiting for the
previous write (a disk slower than the interval) with the publication.

    .venv/bin/python benchmarks/async_save.py [--steps 13] [--every 2] [--hidden 512] [--layers 8]
        [--seq 64] [--gbs 2] [--vocab 1024]
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


def loop_seconds(a: argparse.Namespace, extra: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "WANDB_MODE": "disabled"}
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            "recipe=default", "parallel.tp=1", "parallel.pp=1", "cluster.gpus_per_node=1", "data=synthetic",
            f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", f"model.ffn_hidden_size={4 * a.hidden}",
            "model.num_attention_heads=8", "model.num_query_groups=8", f"model.vocab_size={a.vocab}",
            f"model.max_position_embeddings={max(a.seq, 64)}", f"train.seq_length={a.seq}",
            "train.micro_batch_size=1", f"train.global_batch_size={a.gbs}",
            f"train.steps={a.steps}", "optimizer.warmup_steps=1", "logger.tensorboard.enabled=false",
            f"run_dir={tmp}/run", *[x.replace("CKPT", f"{tmp}/ckpt") for x in extra],
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m", "megatron_bridge.train"]
        out = subprocess.run([*cmd, *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            sys.exit(out.stdout[-3000:] + out.stderr[-3000:])
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    thread = {k: sum(r.get(k, 0.0) for r in rows[1:]) for k in ("save_s", "save_wait_s", "export_s", "export_wait_s")}
    return rows[-1]["time"] - rows[0]["time"], thread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--gbs", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    a = ap.parse_args()
    saves = (a.steps - 1) // a.every  # saves between the first and the last step's line
    ck = ["checkpoint.dir=CKPT", f"checkpoint.save_interval={a.every}"]
    ex = ["export_to=CKPT", f"train.export_interval={a.every}"]
    runs, thread = {}, {}
    for name, extra in (
        ("no checkpoint", []),
        ("sync save", ck),
        ("async_save=true", [*ck, "checkpoint.async_save=true"]),
        ("export in step", [*ex, "train.export_buffer_bytes=0"]),
        ("export behind", ex),
    ):
        runs[name], thread[name] = loop_seconds(a, extra)
    base = runs["no checkpoint"]
    print(
        f"{a.steps} steps, a save every {a.every} ({saves} between the first and last step), "
        f"h={a.hidden} L={a.layers} seq={a.seq} gbs={a.gbs} vocab={a.vocab}"
    )
    print(f"  mean step time without saves: {base / (a.steps - 1) * 1e3:.0f} ms")
    for name, secs in runs.items():
        share = f" ({(secs - base) / base:6.1%} of the loop)"
        stall = f"   stall per save {(secs - base) / saves * 1e3:7.0f} ms{share}" if secs is not base else ""
        kind = "export" if "export" in name else "save"
        took = thread[name][f"{kind}_s"] / saves * 1e3, thread[name][f"{kind}_wait_s"] / saves * 1e3
        parts = f"   (metrics: snapshot {took[0]:6.0f} ms, wait {took[1]:6.0f} ms)" if secs is not base else ""
        print(f"  {name:<16} loop {secs:7.2f} s{stall}{parts}")
    print(f"  async stall / sync stall: {(runs['async_save=true'] - base) / (runs['sync save'] - base):.2f}")
    print(f"  export behind / in step:  {(runs['export behind'] - base) / (runs['export in step'] - base):.2f}")


if __name__ == "__main__":
    main()
