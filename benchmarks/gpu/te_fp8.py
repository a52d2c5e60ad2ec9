"""Transformer Engine on this GPU: an FP8 GEMM step against the same step in bf16.

The kit's `te` check (issue 25 item 6): where TE is importable, one `te.Linear` (h -> 4h, no
bias) runs forward + backward on `tokens` tokens in bf16 and under `te.fp8_autocast`
(delayed scaling), and the script prints each step's time, TFLOP/s (3 GEMMs of 2·t·h·4h
FLOPs) and the FP8 / bf16 speed-up; the kit then runs `mbr verify` with TE's attention in the
model. Where TE is not importable (or there is no CUDA) it prints why and exits 0: the lent
images so far had no TE, so this path has not run yet.

    python3 benchmarks/gpu/te_fp8.py [--hidden 8192] [--tokens 16384] [--reps 10]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def te_missing() -> str | None:
    """Why TE cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # ImportError, or a TE built for another torch/CUDA
        return f"Transformer Engine not importable ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    return None


def step_ms(layer, x, fp8: bool, reps: int) -> float:
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe

    times = []
    for i in range(reps + 2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with te.fp8_autocast(enabled=fp8, fp8_recipe=recipe.DelayedScaling()):
            y = layer(x)
        y.float().sum().backward()
        torch.cuda.synchronize()
        if i >= 2:  # two warm-ups (FP8 scaling history)
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    why = te_missing()
    if why:
        print(f"te: skipped ({why})")
        return 0
    import transformer_engine
    import transformer_engine.pytorch as te

    h, t = a.hidden, a.tokens
    layer = te.Linear(h, 4 * h, bias=False, params_dtype=torch.bfloat16).cuda()
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flops = 3 * 2 * t * h * 4 * h
    ms = {fp8: step_ms(layer, x, fp8, a.reps) for fp8 in (False, True)}
    print(f"Transformer Engine {transformer_engine.__version__}, {torch.cuda.get_device_name()}, h {h}, tokens {t}")
    for fp8, name in ((False, "bf16"), (True, "fp8 (delayed scaling)")):
        print(f"  {name:<22} {ms[fp8]:8.2f} ms  {flops / ms[fp8] / 1e9:7.0f} TFLOP/s")
    print(f"  fp8 / bf16 speed-up: {ms[False] / ms[True]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
