"""FP8 dequantisation kernels against a plain copy of the same output bytes.

    .venv/bin/python benchmarks/fp8_dequant_bench.py [ROWS] [COLS]

One DeepSeek-V3 expert-shaped fp8 tensor (default 2048 x 7168, 128 x 128 block scales) in
memory: the pure-Python tables (`fp8.dequant_rows`, the reference) and the numpy gather
(`fp8.dequant_numpy`, what convert runs), against `shutil.copyfile` of a file the size of the
bf16 output (the `cp` yardstick). Best of 3 of wall and of process CPU time: on a shared box
the CPU time is the per-core rate, the wall time what the load left. The numbers in
docs/benchmarks.md come from this command.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Callable

from megatron_bridge.convert.formats import fp8


def best(f: Callable[[], object]) -> tuple[float, float]:
    runs = []
    for _ in range(3):
        w0, c0 = time.perf_counter(), time.process_time()
        f()
        runs.append((time.perf_counter() - w0, time.process_time() - c0))
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main(rows: int = 2048, cols: int = 7168) -> None:
    w = os.urandom(rows * cols)
    scales = array("f", [1.0 + i * 1e-3 for i in range(-(-rows // 128) * -(-cols // 128))])
    ref = bytes(fp8.dequant_rows(w, cols, scales, 0, (128, 128)))
    assert fp8.dequant_numpy(w, cols, scales, 0, (128, 128)).tobytes() == ref  # the oracle
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "src"), os.path.join(d, "dst")
        with open(src, "wb") as f:
            f.write(ref)
        results = {
            "pure-Python dequant_rows": best(lambda: fp8.dequant_rows(w, cols, scales, 0, (128, 128))),
            "numpy dequant_numpy": best(lambda: fp8.dequant_numpy(w, cols, scales, 0, (128, 128))),
            "cp of the bf16 output bytes": best(lambda: shutil.copyfile(src, dst)),
        }
    cp_wall, cp_cpu = results["cp of the bf16 output bytes"]
    n = rows * cols
    print(f"{rows} x {cols} fp8 -> bf16 ({2 * n / 1e9:.3f} GB out); load average {os.getloadavg()[0]:.1f}")
    for name, (wall, cpu) in results.items():
        print(
            f"{name:30s} wall {wall:6.3f} s ({cp_wall / wall:5.2f}x cp)  cpu {cpu:6.3f} s ({cp_cpu / cpu:5.2f}x cp)"
            f"  {n / cpu / 1e6:7.1f} M weights per cpu-s"
        )


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
