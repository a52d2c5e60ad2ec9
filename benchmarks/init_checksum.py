"""The cost of verifying a converted checkpoint's bytes on `train.init_from` (issue 23 item 2).

    .venv/bin/python benchmarks/init_checksum.py [--dir /tmp/mbr-init-checksum] [--layers 8] [--reps 3]

Writes the synthetic Llama checkpoint of benchmarks/convert_bench.py, converts it (torch_dist
and format=torch tp2), then times, each in this process, `--reps` times with the files in the
page cache (the state right after a conversion or a first read; a cold read is the disk's):

- `Manifest.check_files` with sizes only (the check before) and with every file's CRC-32,
- the trainer's whole preflight as it is now (`check_data_only`: sizes, CRC-32, pickle scan),
- reading every file once (the floor for any check of every byte), and loading the weights
  with `torch.distributed.checkpoint` / `torch.load(weights_only=True)` (what init_from does after).

Prints seconds and the ratio of the checked preflight to the load it protects.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.convert_bench import make_checkpoint  # noqa: E402
from megatron_bridge.convert.formats.manifest import Manifest  # noqa: E402
from megatron_bridge.convert.sources import readers  # noqa: E402


def best(fn, reps: int) -> tuple[float, float]:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts), statistics.median(ts)


def read_all(d: Path) -> None:
    for p in d.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def load(d: Path, fmt: str) -> None:
    import torch

    if fmt == "torch_dist":
        import torch.distributed.checkpoint as dcp

        meta = dcp.FileSystemReader(str(d / "release")).read_metadata()
        sd = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if hasattr(m, "size") and hasattr(m, "properties")
        }
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(d / "release")), no_dist=True)
    else:
        from megatron_bridge.convert.formats.pickle_guard import CONVERTED
        from megatron_bridge.runtime.safe_load import torch_load

        for p in sorted(d.rglob("*.pt")):
            torch_load(p, CONVERTED, map_location="cpu")  # init_from's loader (it maps with mmap=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/mbr-init-checksum")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    nbytes = make_checkpoint(root / "hf", a.layers)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for fmt, extra in (("torch_dist", []), ("torch", ["parallel.tp=2"])):
        out = root / fmt
        cmd = [sys.executable, "-m", "megatron_bridge.cli", "convert", f"src={root / 'hf'}", f"dst={out}"]
        subprocess.run([*cmd, f"format={fmt}", "progress=off", *extra], check=True, env=env, capture_output=True)
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        read_all(out)  # warm
        man = Manifest.read(out)
        checked = best(lambda out=out: readers.check_data_only(out), a.reps)
        sizes_only = best(lambda out=out, man=man: man.check_files(out), a.reps)
        crc_only = best(lambda out=out, man=man: man.check_files(out, checksums=True), a.reps)
        raw = best(lambda out=out: read_all(out), a.reps)
        loaded = best(lambda out=out, fmt=fmt: load(out, fmt), a.reps)
        print(
            f"{fmt}: {size / 1e9:.2f} GB (model {nbytes / 1e9:.2f} GB); best of {a.reps} (median), page cache warm\n"
            f"  files' sizes only         {sizes_only[0]:7.3f} s ({sizes_only[1]:.3f})\n"
            f"  files' CRC-32 checked     {crc_only[0]:7.3f} s ({crc_only[1]:.3f})  {size / crc_only[0] / 1e9:.1f} GB/s\n"
            f"  preflight with CRC-32     {checked[0]:7.3f} s ({checked[1]:.3f})  (sizes + CRC + pickle scan)\n"
            f"  read every byte once      {raw[0]:7.3f} s ({raw[1]:.3f})\n"
            f"  weights load (1 process)  {loaded[0]:7.3f} s ({loaded[1]:.3f})\n"
            f"  CRC-32 cost / load        {(crc_only[0] - sizes_only[0]) / loaded[0]:.2f}x",
            flush=True,
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
