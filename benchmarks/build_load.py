"""Build + load of an HF model at tp2 with megatron's random init and without it.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/build_load.py [--layers 10] [--tp 2] [--reps 1]

1. Writes (once; kept in --dir) a Llama-shaped HF model with transformers: hidden 2048, FFN
   5632, 32 heads / 4 KV heads, vocab 32000, untied, random bf16 weights (~1.14 GB at 10
   layers), and reads it once so both modes start from a warm page cache.
2. For each mode, --reps times, alternating the order: one torchrun launch of --tp
   processes (gloo) that initialise the groups, then `build_model(spec, Layout(tp=...),
   load_weights=MODE, params_dtype=bf16)` and `load_hf_weights` — "random init" is
   megatron's initialisation (every rank draws each full fp32 master weight and keeps its
   slice) followed by the load, "no init" is `load_weights=True` (shard-shape allocation,
   no draw; the loader proves every tensor written).
3. Prints per mode the slowest rank's build, load and build+load seconds, the ratio
   no init / random init, and per rank the peak RSS (VmHWM) above the RSS before the build
   against the rank's shard bytes; both modes must end with the same weights (checksum).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"random init": False, "no init": True}


def make_checkpoint(out: Path, layers: int) -> int:
    """The HF model directory (transformers config + random bf16 weights); its weight bytes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (out / "config.json").is_file():
        cfg = LlamaConfig(
            hidden_size=2048,
            intermediate_size=5632,
            num_attention_heads=32,
            num_key_value_heads=4,
            num_hidden_layers=layers,
            vocab_size=32000,
            max_position_embeddings=2048,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(out)
        del model
    files = sorted(out.glob("*.safetensors"))
    for f in files:  # warm page cache: both modes read the same bytes from memory
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    return sum(f.stat().st_size for f in files)


def _status(key: str) -> int:
    """This process's /proc/self/status value in bytes (VmRSS now, VmHWM = peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def worker(hf: Path, load_weights: bool, tp: int, out: Path) -> None:
    import torch

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.runtime import groups
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import load_hf_weights

    world = int(os.environ["WORLD_SIZE"])
    groups.initialize(ParallelDims(tp=tp, world_size=world, gpus_per_node=world), seed=0)
    spec = load_spec(hf)
    rank = torch.distributed.get_rank()
    torch.distributed.barrier()
    base = _status("VmRSS")
    t0 = time.perf_counter()
    chunks = build_model(spec, Layout(tp=tp), load_weights=load_weights, params_dtype=torch.bfloat16, bf16=True)
    t1 = time.perf_counter()
    n = load_hf_weights(chunks, spec, hf)
    t2 = time.perf_counter()
    peak = _status("VmHWM")
    shard = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    checksum = sum(float(p.float().sum()) for c in chunks for p in c.parameters())
    row = dict(rank=rank, build_s=t1 - t0, load_s=t2 - t1, tensors=n, rss_before=base, peak_rss=peak, shard=shard)
    (out / f"rank{rank}.json").write_text(json.dumps({**row, "checksum": checksum}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch(hf: Path, mode: str, tp: int) -> list[dict]:
    from megatron_bridge.testing import torchrun_cmd

    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as d:
        args = [__file__, "--worker", "--hf", str(hf), "--out", d, "--tp", str(tp)]
        args += ["--load-weights"] if MODES[mode] else []
        p = subprocess.run(torchrun_cmd(tp, *args), capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800)
        if p.returncode:
            sys.exit(f"{mode}: launch failed\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return sorted((json.loads(f.read_text()) for f in Path(d).glob("rank*.json")), key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/mbr-build-load-bench")
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--hf", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--load-weights", action="store_true")
    a = ap.parse_args()
    if a.worker:
        worker(a.hf, a.load_weights, a.tp, a.out)
        return
    hf = Path(a.dir) / f"llama-{a.layers}l"
    nbytes = make_checkpoint(hf, a.layers)
    print(f"model: {hf} ({nbytes / 2**30:.2f} GiB bf16), tp{a.tp} on {a.tp} processes (gloo)")
    runs: dict[str, list[list[dict]]] = {m: [] for m in MODES}
    for rep in range(a.reps):
        for mode in list(MODES)[:: 1 if rep % 2 == 0 else -1]:
            runs[mode].append(launch(hf, mode, a.tp))
    best = {}
    for mode, reps in runs.items():
        totals = [max(r["build_s"] + r["load_s"] for r in ranks) for ranks in reps]
        ranks = reps[totals.index(min(totals))]
        best[mode] = min(totals)
        print(
            f"{mode:12s} build {max(r['build_s'] for r in ranks):6.2f} s  load {max(r['load_s'] for r in ranks):6.2f} s"
            f"  build+load {min(totals):6.2f} s (best of {len(reps)}; all {', '.join(f'{t:.2f}' for t in totals)})"
        )
        for r in ranks:
            print(
                f"    rank {r['rank']}: peak RSS {r['peak_rss'] / 2**20:7.0f} MiB, {(r['peak_rss'] - r['rss_before']) / 2**20:6.0f}"
                f" MiB above the RSS before the build; shard {r['shard'] / 2**20:6.0f} MiB; {r['tensors']} tensors loaded"
            )
    sums = {m: [r["checksum"] for r in reps[0]] for m, reps in runs.items()}
    same = len({tuple(s) for s in sums.values()}) == 1
    print(f"same weights after both: {same}")
    print(f"ratio no init / random init (build+load): {best['no init'] / best['random init']:.3f}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
