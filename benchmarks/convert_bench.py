"""Conversion throughput and memory against `cp -r` (the disk limit), in one run.

    .venv/bin/python benchmarks/convert_bench.py [--dir /tmp/mbr-convert-bench] [--layers 16] [--reps 3] [--warm] [--keep]
        [--only tp2·pp2]   # just the jobs whose names contain it: convert tp2·pp2, its export, both reshards

1. Writes a synthetic Llama-architecture HF checkpoint (random bf16 weights, hidden 2048,
   FFN 5632, 32 heads / 4 KV heads, vocab 32000, untied; ~1.7 GB at 16 layers) as several
   safetensors files + index, with safetensors directly (no transformers model in memory).
2. Times, each as its own process, `--reps` times: a plain user-space copy of the source
   (benchmarks/user_copy.py: read/write through one buffer — cp itself copies inside the
   kernel with copy_file_range, so this is the floor for any converter that has to look at
   the bytes), `mbr convert` format=torch at tp2·pp2,
   `mbr convert` format=torch_dist, `mbr export` of both outputs, `mbr reshard` tp2·pp2 ->
   tp1·pp4 on its byte path and on its tensor path (`MBR_CONVERT_DIRECT=0`; the two outputs
   must be the same files: their manifests' file CRC-32s are compared) — each right after a `cp -r` of the source (the disk limit), so every ratio
   compares two runs made under the same machine load (the box is shared). Before each run:
   its input is evicted from the page cache (unless --warm), then `sync` and a pause
   (--settle, 3 s: the previous run's deletions settle), so every command
   reads from disk as cp does. Each run is timed to its exit and again after a final `sync`
   (data on disk): dirty-page writeback makes the first optimistic, the second is the disk's.
3. Prints best and median seconds, GB/s (model bytes / seconds with sync), throughput
   relative to cp's (best against best, and the median of each run against the cp right
   before it); the same with start-up excluded (the command's own time from its
   summary line, i.e. without the interpreter start-up — ~0.4 s for convert and export,
   which never import torch, nor does reshard's byte path; ~2 s with torch — plus the sync
   after its exit); CPU seconds, and the peak RSS (`/usr/bin/time`) against the bound
   2 × largest tensor + 1 GiB; then checks the exports are bit-exact against the source.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from disk import SETTLE_SECONDS, evict, settle

ROOT = Path(__file__).resolve().parents[1]
MBR = [sys.executable, "-m", "megatron_bridge.cli"]


def make_checkpoint(out: Path, layers: int, files: int = 4) -> int:
    """Synthetic Llama checkpoint; returns its weight bytes."""
    from safetensors.torch import save_file

    h, ffn, heads, kv, vocab = 2048, 5632, 32, 4, 32000
    d = h // heads
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (heads * d, h),
                p + "self_attn.k_proj.weight": (kv * d, h),
                p + "self_attn.v_proj.weight": (kv * d, h),
                p + "self_attn.o_proj.weight": (h, heads * d),
                p + "mlp.gate_proj.weight": (ffn, h),
                p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn),
            }
        )
    names = list(shapes)
    per = -(-len(names) // files)
    groups = [names[i : i + per] for i in range(0, len(names), per)]
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: (torch.randn(shapes[n], generator=g) * 0.02).to(torch.bfloat16) for n in group}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = fname
            total += t.nbytes
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text('{"model_max_length": 4096}\n')
    (out / "bench.json").write_text(json.dumps({"layers": layers, "bytes": total}))
    return total


# "%M %U %S" of a command into a file: /usr/bin/time, or where an image lacks it a bare Python
# that forks the command and reads its rusage (a small process, like time, so the same holds).
RUSAGE = ["/usr/bin/time", "-f", "%M %U %S", "-o"]
if not Path("/usr/bin/time").exists():
    RUSAGE = [
        sys.executable,
        "-S",
        "-c",
        "import os,sys,subprocess as s;p=s.Popen(sys.argv[2:]);_,st,u=os.wait4(p.pid,0);"
        "open(sys.argv[1],'w').write(f'{u.ru_maxrss} {u.ru_utime} {u.ru_stime}');"
        "sys.exit(os.waitstatus_to_exitcode(st))",
    ]


def timed(cmd, rss_file: Path, cwd=ROOT):
    """(seconds to exit, seconds to exit + sync, peak RSS bytes, output, CPU seconds). The peak RSS comes
    from /usr/bin/time (RUSAGE), a small process that runs the command: a child forked straight
    from this (large) Python process would inherit its high-water mark in ru_maxrss."""
    subprocess.run(["sync"], check=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*RUSAGE, str(rss_file), *map(str, cmd)],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "CI": "1"},
    )
    t_exit = time.perf_counter() - t0
    subprocess.run(["sync"], check=True)
    t_sync = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}")
    rss_kb, user, system = rss_file.read_text().split()[-3:]
    return t_exit, t_sync, int(rss_kb) * 1024, proc.stdout, float(user) + float(system)


def check_exact(src: Path, exported: Path) -> str:
    from safetensors import safe_open

    idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    got = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    if set(idx) != set(got):
        return "names differ"
    handles = {}
    for name in idx:
        a = safe_open(str(src / idx[name]), "pt").get_tensor(name)
        f = exported / got[name]
        handles.setdefault(f, safe_open(str(f), "pt"))
        b = handles[f].get_tensor(name)
        if a.dtype != b.dtype or not torch.equal(a, b):
            return f"{name} differs"
    return "bit-exact"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/mbr-convert-bench")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="runs of every command; medians are reported")
    ap.add_argument("--warm", action="store_true", help="leave inputs in the page cache (default: read from disk)")
    ap.add_argument("--keep", action="store_true", help="keep the generated source for the next run")
    ap.add_argument(
        "--settle", type=float, default=SETTLE_SECONDS, help="seconds of quiet (after a sync) before every timed run"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated parts of job names to run (with the jobs they read from), e.g. 'tp2·pp2'",
    )
    ap.add_argument(
        "--workers",
        default="",
        help="comma-separated workers= counts: every mbr job runs once per count, e.g. '1,2' (default: the default)",
    )
    a = ap.parse_args()
    base = Path(a.dir)
    src = base / "hf"
    meta = src / "bench.json"
    if not (meta.is_file() and json.loads(meta.read_text())["layers"] == a.layers):
        shutil.rmtree(base, ignore_errors=True)
        t0 = time.perf_counter()
        make_checkpoint(src, a.layers)
        print(f"generated {src} in {time.perf_counter() - t0:.1f} s")
    nbytes = json.loads(meta.read_text())["bytes"]
    largest = 32000 * 2048 * 2
    bound = 2 * largest + 2**30
    print(
        f"model: {a.layers} layers, {nbytes / 1e9:.3f} GB of bf16 weights in "
        f"{len(list(src.glob('*.safetensors')))} files; largest tensor {largest / 1e6:.0f} MB -> "
        f"RSS bound {bound / 2**30:.2f} GiB; inputs {'in the page cache' if a.warm else 'read from disk'}"
    )
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; python {sys.version.split()[0]}, "
        f"torch {torch.__version__}"
    )
    cp = ["cp", "-r", src, base / "cp"]
    jobs = [
        ("user-space copy (reference)", [sys.executable, ROOT / "benchmarks" / "user_copy.py", src, base / "ucp"], src),
        (
            "convert torch tp2·pp2",
            MBR + ["convert", f"src={src}", f"dst={base / 't22'}", "format=torch", "parallel.tp=2", "parallel.pp=2"],
            src,
        ),
        ("convert torch_dist", MBR + ["convert", f"src={src}", f"dst={base / 'dist'}"], src),
        (
            "export (from torch_dist)",
            MBR + ["export", f"src={base / 'dist'}", f"dst={base / 'exp_dist'}", "max_shard_gb=0.5"],
            base / "dist",
        ),
        (
            "export (from torch tp2·pp2)",
            MBR + ["export", f"src={base / 't22'}", f"dst={base / 'exp_t22'}", "max_shard_gb=0.5"],
            base / "t22",
        ),
        (
            "reshard tp2·pp2 -> tp1·pp4",
            MBR + ["reshard", f"src={base / 't22'}", f"dst={base / 't14'}", "parallel.tp=1", "parallel.pp=4"],
            base / "t22",
        ),
        (
            "reshard tp2·pp2 -> tp1·pp4, tensor path",
            ["env", "MBR_CONVERT_DIRECT=0", *MBR, "reshard", f"src={base / 't22'}", f"dst={base / 't14t'}"]
            + ["parallel.tp=1", "parallel.pp=4"],
            base / "t22",
        ),
    ]

    if a.only:  # a job whose input another one writes needs that one first: both names contain the filter
        jobs = [j for j in jobs if any(part in j[0] for part in a.only.split(","))]
    if a.workers:  # each mbr job once per count (the last one's output is what the next job reads)
        jobs = [
            (f"{name}, workers={w}", cmd + [f"workers={w}"], inp) if "user-space" not in name else (name, cmd, inp)
            for name, cmd, inp in jobs
            for w in (a.workers.split(",") if "user-space" not in name else [""])
        ]

    def measure(cmd, inp):
        if not a.warm:
            evict(inp)
        settle(a.settle)
        t_exit, t_sync, rss, out, cpu = timed(cmd, base / "rss.txt")
        m = re.search(r" in ([0-9.]+) s \(", out)
        return t_exit, t_sync, float(m.group(1)) if m else None, rss, cpu

    results = {name: [] for name, _, _ in jobs}
    cps = []
    for rep in range(a.reps):
        for p in base.iterdir():
            if p.name != "hf":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        for name, cmd, inp in jobs:  # cp right before each command: the ratio compares like with like
            for arg in map(str, cmd):  # a job repeated with another workers= count: its output again
                if arg.startswith("dst="):
                    shutil.rmtree(arg[4:], ignore_errors=True)
            c = measure(cp, src)
            shutil.rmtree(base / "cp")
            r = measure(cmd, inp)
            cps.append(c)
            results[name].append(r + (c[1] / r[1],))
            print(
                f"  run {rep + 1} {name}: {r[0]:.2f} s ({r[1]:.2f} s with sync), peak RSS {r[3] / 2**30:.2f} GiB; "
                f"cp just before: {c[1]:.2f} s with sync",
                flush=True,
            )
    med = statistics.median
    cp_best = min(c[1] for c in cps)
    print()
    print(
        f"{a.reps} runs each. 'best' = fastest run (least disturbed by other load on the shared box), 'median' "
        f"likewise; times include the final sync. GB/s = model bytes / best time. 'vs cp' = cp's best time / the "
        f"command's best time; 'vs the cp before it' = the median over runs of (the cp timed right before it) / (its "
        f"time): the disk slows as a run writes more, and this ratio pairs runs made at the same point. cp -r itself: best {cp_best:.2f} s ({nbytes / 1e9 / cp_best:.2f} GB/s), median "
        f"{med(c[1] for c in cps):.2f} s, {med(c[4] for c in cps):.2f} CPU s. 'start-up excluded' = the command's own "
        f"summary line (from its first read to its last write, without the start-up: ~0.4 s of interpreter + Hydra "
        f"for convert, export and reshard's byte path, ~2 s with torch for the tensor path) plus the sync after its exit; CPU s = user + system of "
        f"the whole process."
    )
    print()
    print(
        "| operation | best s | median s | GB/s | vs cp -r | vs the cp before it, median | start-up excluded: s, GB/s, "
        "vs cp -r | CPU s | peak RSS GiB | ≤ bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rs in results.items():
        best, median = min(r[1] for r in rs), med(r[1] for r in rs)
        # the command's own time (its summary line) + what was still to write at its exit (the sync after it)
        own = [r[2] + (r[1] - r[0]) for r in rs if r[2] is not None]
        rss = max(r[3] for r in rs)
        inside = f"{min(own):.2f}, {nbytes / 1e9 / min(own):.2f}, {cp_best / min(own):.2f}×" if own else "-"
        print(
            f"| {name} | {best:.2f} | {median:.2f} | {nbytes / 1e9 / best:.2f} | {cp_best / best:.2f}× | "
            f"{med(r[5] for r in rs):.2f}× | {inside} | "
            f"{min(r[4] for r in rs):.1f} | {rss / 2**30:.2f} | {'yes' if rss <= bound else 'NO'} |"
        )
    for name in (n for n in ("exp_dist", "exp_t22") if (base / n).is_dir()):
        print(f"{name}: {check_exact(src, base / name)} vs the source")
    if (base / "t14").is_dir() and (base / "t14t").is_dir():  # the two reshard paths: the same files?
        same = [json.loads((base / d / "mbr_manifest.json").read_text())["file_crc32"] for d in ("t14", "t14t")]
        print(f"reshard, bytes vs tensor path: {'identical files' if same[0] == same[1] else 'FILES DIFFER'}")
    if not a.keep:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
