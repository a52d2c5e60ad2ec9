"""The passes a byte-path conversion makes over its data, each against its alternative.

    .venv/bin/python benchmarks/byte_passes.py [SRC_DIR]   # default: convert_bench.py's model

Over the safetensors files of SRC_DIR (read once first, so every pass reads the page cache):

1. CRC-32 (zlib-ng) of every file read with `pread` into one reused 8 MiB buffer (the old
   checksum pass) vs through short-lived 64 MiB memory maps (`formats/mapped.py`);
2. the non-finite check (bf16 exponent bits) over the same bytes as one whole-array
   mask-and-compare per 64 MiB vs `finite.all_finite` (a cache-sized block at a time into a
   reused buffer);
3. copying the files with `copy_file_range`: one thread (what cp does), two threads into one
   output file, two threads into two files (why a torch_dist output is spread over several
   `.distcp` files, `dist_ckpt.data_files`).

Prints seconds (best of --reps) and each alternative's ratio to the baseline. The numbers in
docs/benchmarks.md ("Convert at disk speed") come from this command.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from zlib_ng import zlib_ng

from megatron_bridge.convert.formats.dtypes import BY_NAME
from megatron_bridge.convert.formats.finite import all_finite
from megatron_bridge.convert.formats.mapped import WINDOW, crc32_range, mapped


def best(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def crc_pread(files: list[Path]) -> None:
    buf = memoryview(bytearray(8 * 2**20))
    for f in files:
        fd, pos, crc = os.open(f, os.O_RDONLY), 0, 0
        while k := os.preadv(fd, [buf], pos):
            crc = zlib_ng.crc32(buf[:k], crc)
            pos += k
        os.close(fd)


def crc_mapped(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        crc32_range(fd, 0, os.fstat(fd).st_size, f)
        os.close(fd)


def finite_pass(files: list[Path], check: Callable[[memoryview], bool]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        size = os.fstat(fd).st_size // 2 * 2
        for pos in range(0, size, WINDOW):
            with mapped(fd, pos, min(size, pos + WINDOW), f) as view:
                check(view)
        os.close(fd)


def whole_array(view: memoryview) -> bool:
    a = np.frombuffer(view, dtype="<u2")
    return not bool(np.any(np.bitwise_and(a, 0x7F80) == 0x7F80))


def copy_files(pairs: list[tuple[Path, Path, int]]) -> None:
    """copy_file_range each (source, output, offset in the output)."""
    for src, dst, at in pairs:
        fi = os.open(src, os.O_RDONLY)
        fo = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o644)
        n, done = os.fstat(fi).st_size, 0
        while done < n:
            done += os.copy_file_range(fi, fo, n - done, done, at + done)
        os.close(fi)
        os.close(fo)


def copies(files: list[Path], out: Path, threads: int, one_file: bool) -> Callable[[], float]:
    sizes = [f.stat().st_size for f in files]
    offsets = [sum(sizes[:i]) for i in range(len(files))]
    if one_file:
        pairs = [(f, out / "one", offsets[i]) for i, f in enumerate(files)]
    else:
        pairs = [(f, out / f"t{i % threads}", offsets[i]) for i, f in enumerate(files)]

    def run() -> float:
        """Seconds for the copies alone (the clean-up and sync before them not counted)."""
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        os.sync()
        ts = [threading.Thread(target=copy_files, args=(pairs[k::threads],)) for k in range(threads)]
        t = time.perf_counter()
        for x in ts:
            x.start()
        for x in ts:
            x.join()
        return time.perf_counter() - t

    return run


def timed_copies(fn: Callable[[], float], reps: int) -> float:
    return min(fn() for _ in range(reps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("src", nargs="?", default="/tmp/mbr-convert-bench/hf")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="/tmp/mbr-byte-passes")
    a = ap.parse_args()
    files = sorted(Path(a.src).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no safetensors files in {a.src}: run benchmarks/convert_bench.py --keep first")
    gb = sum(f.stat().st_size for f in files) / 1e9
    crc_pread(files)  # into the page cache
    bf16 = BY_NAME["bfloat16"]
    print(f"{len(files)} files, {gb:.2f} GB, page cache warm; {os.cpu_count()} cores; best of {a.reps}\n")
    print("| pass | baseline s | alternative s | alternative / baseline (time) |")
    print("|---|---|---|---|")
    base, alt = best(lambda: crc_pread(files), a.reps), best(lambda: crc_mapped(files), a.reps)
    print(f"| CRC-32: pread into a buffer -> memory maps | {base:.2f} | {alt:.2f} | {alt / base:.2f} |")
    base = best(lambda: finite_pass(files, whole_array), a.reps)
    alt = best(lambda: finite_pass(files, lambda v: all_finite(bf16, v)), a.reps)
    print(
        f"| non-finite check: whole array -> blocks into a reused buffer | {base:.2f} | {alt:.2f} | {alt / base:.2f} |"
    )
    out = Path(a.out)
    base = timed_copies(copies(files, out, 1, one_file=False), a.reps)
    one = timed_copies(copies(files, out, 2, one_file=True), a.reps)
    two = timed_copies(copies(files, out, 2, one_file=False), a.reps)
    print(f"| copy_file_range: 1 thread -> 2 threads into one file | {base:.2f} | {one:.2f} | {one / base:.2f} |")
    print(f"| copy_file_range: 1 thread -> 2 threads into two files | {base:.2f} | {two:.2f} | {two / base:.2f} |")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
