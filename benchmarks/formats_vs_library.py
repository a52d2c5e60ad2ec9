"""The converter's hand-written writers against the library calls they stand in for.

    .venv/bin/python benchmarks/formats_vs_library.py [--dir /tmp/mbr-formats-bench] [--layers 8] [--reps 3]

Three writers are kept by hand in `convert/formats/` so that `mbr convert` / `mbr export`
never import torch and stream with bounded memory. Each is compared with the library call
that writes the same format:

| format | ours | library |
|---|---|---|
| per-rank `torch.save` zip (`format=torch`) | `torch_zip.StreamingTorchSave` | `torch.save(state_dict, path)` |
| torch_dist (DCP + megatron files) | `dist_ckpt.DistWriter` | `torch.distributed.checkpoint.save(sd, checkpoint_id=.., no_dist=True)` |
| safetensors (`mbr export`) | `safetensors_io.SafetensorsWriter` | `safetensors.torch.save_file(sd, path)` |

on a ~1 GB Llama-shaped bf16 model (hidden 2048, FFN 5632, 32/4 heads, vocab 32000, untied;
0.97 GB at 8 layers; largest tensor the 131 MB embedding), in two settings:

* **tensors**: the tensors are made in the process (the tensor path: reshard, casts). Ours
  takes one tensor at a time (made, written, freed); a library call takes the whole state
  dict, so the process makes every tensor first. Both import torch.
* **bytes**: the tensors are in a safetensors file (the page cache warm) and the output is
  those bytes re-laid (the byte path of `mbr convert` / `mbr export`). Ours reserves each
  record and fills it with `os.copy_file_range`, without torch; the library run imports
  torch (and DCP), loads the file (`safetensors.torch.load_file`) and saves.

Every run is its own process (`sync` before it, not timed); the start-up of a bare
interpreter and of the imports the library runs need is printed first. Printed per case: the process's
wall time (start-up and imports included), the time inside the write calls, its peak RSS
(VmHWM), and each ratio ours / library. Outputs are written to the page cache (no sync in
the timed part): the comparison is of the writers, not of the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("torch_save", "dcp", "safetensors")


def shapes(layers: int) -> dict[str, tuple[int, ...]]:
    h, ffn, heads, kv, vocab = 2048, 5632, 32, 4, 32000
    d = h // heads
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (vocab, h)}
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out |= {
            p + "self_attention.linear_qkv.layer_norm_weight": (h,),
            p + "self_attention.linear_qkv.weight": ((heads + 2 * kv) * d, h),
            p + "self_attention.linear_proj.weight": (h, heads * d),
            p + "mlp.linear_fc1.layer_norm_weight": (h,),
            p + "mlp.linear_fc1.weight": (2 * ffn, h),
            p + "mlp.linear_fc2.weight": (h, ffn),
        }
    return out | {"decoder.final_layernorm.weight": (h,), "output_layer.weight": (vocab, h)}


def make(i: int, shape: tuple[int, ...]):
    import torch

    return torch.empty(shape, dtype=torch.bfloat16).fill_((i % 7 - 3) / 64)


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


# -- ours -----------------------------------------------------------------------------------
class Timer:
    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self, fn, *a):
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            self.s += time.perf_counter() - t


def ours(fmt: str, mode: str, out: Path, layers: int, source: Path) -> float:
    from megatron_bridge.convert.formats.dist_ckpt import DistLocation, DistWriter
    from megatron_bridge.convert.formats.dtypes import BFLOAT16
    from megatron_bridge.convert.formats.safetensors_io import SafetensorsWriter, read_header
    from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave

    sh, timer = shapes(layers), Timer()
    src = read_header(source) if mode == "bytes" else {}
    fd = os.open(source, os.O_RDONLY) if mode == "bytes" else -1

    def copy(name: str, out_fd: int, at: int) -> None:
        info, off = src[name], src[name].start
        while off < info.end:
            off += os.copy_file_range(fd, out_fd, info.end - off, off, at + off - info.start)

    if fmt == "torch_save":
        w = timer(StreamingTorchSave, out / "model_optim_rng.pt")
        refs = {}
        for i, (name, shape) in enumerate(sh.items()):
            if mode == "bytes":
                ref, at = timer(w.reserve, src[name].nbytes, BFLOAT16, shape)
                timer(copy, name, w.fileno(), at)
            else:
                t = make(i, shape)
                ref = timer(w.add, t)
                del t
            refs[name] = ref
        timer(w.finish, {"model": refs, "checkpoint_version": 3.0, "iteration": 0})
    elif fmt == "dcp":
        d = timer(DistWriter, out)
        for i, (name, shape) in enumerate(sh.items()):
            if mode == "bytes":

                def fill(item, stored, name=name):
                    ref, at = item.reserve(src[name].nbytes, BFLOAT16, stored)
                    copy(name, item.fileno(), at)
                    return ref

            else:
                t = make(i, shape)

                def fill(item, stored, t=t):
                    return item.add(t.reshape(stored))

            timer(d.add, DistLocation(name), BFLOAT16, shape, fill)
        timer(d.finish, {"checkpoint_version": 3.0, "iteration": 0})
    else:
        s = timer(SafetensorsWriter, out / "model.safetensors", [(n, BFLOAT16, shape) for n, shape in sh.items()])
        for i, (name, shape) in enumerate(sh.items()):
            if mode == "bytes":
                out_fd, at = timer(s.reserve, name)
                timer(copy, name, out_fd, at)
            else:
                t = make(i, shape)
                timer(s.write, name, t)
                del t
        timer(s.close)
    return timer.s


# -- the library ----------------------------------------------------------------------------
def library(fmt: str, mode: str, out: Path, layers: int, source: Path) -> float:
    import torch

    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp
    if mode == "bytes":
        from safetensors.torch import load_file

        sd = load_file(str(source))
    else:
        sd = {name: make(i, shape) for i, (name, shape) in enumerate(shapes(layers).items())}
    t = time.perf_counter()
    if fmt == "torch_save":
        torch.save({"model": sd, "checkpoint_version": 3.0, "iteration": 0}, out / "model_optim_rng.pt")
    elif fmt == "dcp":
        dcp.save(sd, checkpoint_id=str(out), no_dist=True)
    else:
        from safetensors.torch import save_file

        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return time.perf_counter() - t


# -- driver ---------------------------------------------------------------------------------
def child(a: argparse.Namespace) -> None:
    fmt, who, mode = a.case.split(":")
    out = Path(a.dir) / "out" / a.case.replace(":", "-")
    out.mkdir(parents=True)
    source = Path(a.dir) / "source.safetensors"
    write_s = (ours if who == "ours" else library)(fmt, mode, out, a.layers, source)
    nbytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    torch_loaded = "torch" in sys.modules
    print(json.dumps({"write_s": write_s, "rss": peak_rss_gib(), "bytes": nbytes, "torch": torch_loaded}))


def run_case(a: argparse.Namespace, case: str) -> dict:
    import shutil

    shutil.rmtree(Path(a.dir) / "out", ignore_errors=True)
    os.sync()
    cmd = [sys.executable, __file__, "--case", case, "--dir", a.dir, "--layers", str(a.layers)]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t
    if res.returncode:
        raise SystemExit(f"{case} failed:\n{res.stderr[-3000:]}")
    return dict(json.loads(res.stdout.strip().splitlines()[-1]), wall=wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/mbr-formats-bench")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--case")
    a = ap.parse_args()
    if a.case:
        return child(a)

    import torch
    from safetensors.torch import save_file

    Path(a.dir).mkdir(parents=True, exist_ok=True)
    sd = {name: make(i, shape) for i, (name, shape) in enumerate(shapes(a.layers).items())}
    size = sum(t.nbytes for t in sd.values())
    save_file(sd, str(Path(a.dir) / "source.safetensors"))
    del sd
    print(f"model: {a.layers} layers, {size / 1e9:.3f} GB bf16; torch {torch.__version__}; medians of {a.reps} runs")
    imports = {}
    for what in ("pass", "import torch", "import torch.distributed.checkpoint", "import safetensors.torch"):
        runs = []
        for _ in range(a.reps):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", what], check=True)
            runs.append(time.perf_counter() - t)
        imports[what] = statistics.median(runs)
    print("process start-up, median s: " + ", ".join(f"`python -c '{w}'` {s:.2f}" for w, s in imports.items()))
    for mode in ("tensors", "bytes"):
        for fmt in FORMATS:
            got = {who: [run_case(a, f"{fmt}:{who}:{mode}") for _ in range(a.reps)] for who in ("ours", "library")}
            line = [f"{fmt:11s} {mode:7s}"]
            for key, unit in (("wall", "s"), ("write_s", "s"), ("rss", "GiB")):
                o, lib = [r[key] for r in got["ours"]], [r[key] for r in got["library"]]
                mo, ml = statistics.median(o), statistics.median(lib)
                best = f" (best {min(o):.2f} / {min(lib):.2f})" if key != "rss" else ""
                line.append(f"{key} ours {mo:.2f} library {ml:.2f} {unit}{best} ratio {mo / ml:.2f}")
            torch_note = "ours imports torch" if got["ours"][0]["torch"] else "ours: no torch"
            print(" | ".join(line) + f" | {torch_note}", flush=True)
    import shutil

    shutil.rmtree(Path(a.dir) / "out", ignore_errors=True)


if __name__ == "__main__":
    main()
