"""Which attention kernel a head dim gets, and what it costs: forward + backward of causal bf16
attention at one sequence length, for head dims 128/256/512, with and without grouped KV heads.

Rows: PyTorch SDPA as `runtime/cp_attention.py` calls it (`enable_gqa`, `is_causal`), SDPA with
the KV heads repeated first (no `enable_gqa`), SDPA restricted to each backend in turn (flash,
efficient, cuDNN, math; "n/a" where the backend refuses the inputs), and an unfused bf16
reference (scores = q·kᵀ, masked softmax, ·v: what megatron-core's local attention computes).
"runtime eager" is what `runtime/cp_attention.py` runs above head dim 256 on a GPU.
Written to explain the head-dim-512 gap in docs/benchmarks.md ("GPU"); needs CUDA.

    python3 benchmarks/gpu/sdpa_headdim.py [--seq 4096] [--hidden 4096] [--reps 5]
"""

from __future__ import annotations

import argparse
import math
import time
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def unfused(q, k, v, scale: float):
    """megatron-core's local attention: bf16 matmuls, fp32-free softmax over masked scores."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    n = q.shape[-2]
    mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return torch.matmul(probs, v)


def runtime_eager(q, k, v, scale: float):
    """What runtime/cp_attention.py takes above head dim 256: its eager_attention (fp32 softmax)."""
    from megatron_bridge.runtime.cp_attention import allowed_mask, eager_attention

    pos = torch.arange(q.shape[-2], device=q.device)
    return eager_attention(q, k, v, allowed_mask(pos, pos, True, None), scale)


def sdpa(q, k, v, scale: float, gqa: bool):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)


def repeated(q, k, v, scale: float):
    rep = q.shape[1] // k.shape[1]
    return sdpa(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), scale, False)


def time_ms(fn, q, k, v, reps: int) -> float:
    """Median ms of forward + backward."""
    out = []
    for i in range(reps + 1):
        for t in (q, k, v):
            t.grad = None
        sync()
        start = time.perf_counter()
        fn(q, k, v).sum().backward()
        sync()
        if i:  # the first is a warm-up
            out.append((time.perf_counter() - start) * 1e3)
    return sorted(out)[len(out) // 2]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="CPU, seq 128, hidden 1024: the kit's dry run")
    a = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)  # each refused backend says why, per call
    if a.smoke:
        a.seq, a.hidden, a.reps = 128, 1024, 1
    dev = "cpu" if a.smoke else "cuda"
    name = "CPU" if a.smoke else torch.cuda.get_device_name()
    print(f"torch {torch.__version__}, {name}, seq {a.seq}, hidden {a.hidden}, bf16 causal")
    for head_dim in (128, 256, 512):
        heads = a.hidden // head_dim
        for groups in (heads, heads // 2):
            gqa = groups != heads
            torch.manual_seed(0)
            q = torch.randn(1, heads, a.seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(1, groups, a.seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(1, groups, a.seq, head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
            scale = 1 / math.sqrt(head_dim)
            rows = {
                "sdpa as called": partial(sdpa, scale=scale, gqa=gqa),
                "unfused bf16": partial(unfused, scale=scale),
                "runtime eager (fp32 softmax)": partial(runtime_eager, scale=scale),
            }
            if gqa:
                rows["sdpa, kv repeated"] = partial(repeated, scale=scale)
            for name, backend in (
                ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("math", SDPBackend.MATH),
            ):
                rows[f"only {name}"] = partial(_only, backend, scale=scale, gqa=gqa)
            with torch.no_grad():
                diff = (runtime_eager(q, k, v, scale) - sdpa(q, k, v, scale, gqa)).abs().max().item()
            cells = [f"eager vs sdpa max |diff| {diff:.2g}"]
            for name, fn in rows.items():
                try:
                    cells.append(f"{name} {time_ms(fn, q, k, v, a.reps):.2f}")
                except RuntimeError as e:  # a backend that refuses these inputs
                    cells.append(f"{name} n/a ({str(e).splitlines()[0][:60]})")
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(f"head_dim {head_dim} heads {heads} kv {groups}: " + " | ".join(cells), flush=True)


def _only(backend, q, k, v, scale: float, gqa: bool):
    with sdpa_kernel([backend]):
        return sdpa(q, k, v, scale, gqa)


if __name__ == "__main__":
    main()
