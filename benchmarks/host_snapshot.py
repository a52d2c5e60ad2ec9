"""What the async save's snapshot costs the step: fresh host memory against reused staging
buffers (`train/host_staging.py`; pinned on a GPU).

One process, no training: a state shaped like a rank's checkpoint (bf16 weights, fp32 main
weights, two fp32 Adam moments; tensors of `--mb` MiB each, `--gb` GiB in all) on the GPU
when there is one (else the CPU), snapshotted `--repeat` times each way: `host_snapshot(state)`
(new pageable memory per save: what async_save did before 2026-11-28) and
`host_snapshot(state, staging)` (the first call allocates, the later ones reuse). Prints the
median seconds of each, GB/s, and the ratio staged / fresh.

    python benchmarks/host_snapshot.py [--gb 4] [--mb 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_bridge.train.host_staging import HostStaging, host_snapshot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    n = max(1, int(a.gb * 1024 / a.mb))
    elems = a.mb * 2**20 // 4
    state = {"model": [], "optimizer": []}
    for i in range(n):  # one in six of the bytes are bf16 weights, the rest fp32 (main, exp_avg, exp_avg_sq)
        dtype = torch.bfloat16 if i % 6 == 0 else torch.float32
        t = torch.randn(elems * 4 // dtype.itemsize, device=device).to(dtype)
        state["model" if dtype == torch.bfloat16 else "optimizer"].append(t)
    total = sum(t.numel() * t.element_size() for part in state.values() for t in part)

    def timed(fn) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        assert torch.equal(out["model"][0].float(), state["model"][0].float().cpu())
        return dt

    fresh = [timed(lambda: host_snapshot(state)) for _ in range(a.repeat)]
    staging = HostStaging()
    first = timed(lambda: host_snapshot(state, staging))
    reused = [timed(lambda: host_snapshot(state, staging)) for _ in range(a.repeat)]
    f, r = statistics.median(fresh), statistics.median(reused)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"state {total / 1e9:.2f} GB on {name}: {n} tensors of {a.mb} MiB")
    print(f"fresh host memory (median of {a.repeat})  {f:8.3f} s  {total / f / 1e9:6.1f} GB/s")
    print(f"staging, first save (allocates)  {first:8.3f} s  {total / first / 1e9:6.1f} GB/s")
    print(f"staging, reused (median of {a.repeat})     {r:8.3f} s  {total / r / 1e9:6.1f} GB/s")
    print(f"staged / fresh                   {r / f:8.3f}")


if __name__ == "__main__":
    main()
