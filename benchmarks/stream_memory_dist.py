"""Peak extra host memory of the RL weight stream (`megatron_bridge.stream.hf_buckets`) on every
rank of a multi-process job (gloo, CPU), against the bound docs/rl.md states, the same in both
modes: max(`bucket_bytes`, largest) + largest + `GATHER_CHUNK_BYTES` (16 MiB) — the bucket a
rank holds (a tensor over `bucket_bytes` is a bucket of its own), the next tensor being gathered
(straight into its merged HF tensor, runtime/weights_base.gather_merged), and the one receive
buffer for shard rows that do not land in place. With `bucket_bytes` >= largest that is
`bucket_bytes` + largest + 16 MiB.

Run it twice: with glibc's default malloc, freed heap memory of many mid-sized tensors is kept
by the process (RSS, not live tensors); `MALLOC_MMAP_THRESHOLD_=131072` maps every allocation
over 128 KiB on its own, so the figure is the live memory the bound is about.

Five jobs of 4 processes each: a Llama-shaped fp32 model at tp2.pp2, a Mixtral-shaped one at
ep2.tp2 (experts gathered over EP), a Qwen3-MoE-shaped one at ep2.tp2 on the transformers backend
(transformers' stacked experts, 4 per layer: 128 MiB of gate/up, exported per expert) and a
Granite-MoE-shaped one likewise (its checkpoint stacks the experts too: `WholeStackedExperts`,
one 128 MiB tensor gathered over EP and TP), and a GPT-OSS-shaped one at ep2.tp2 (etp1: its
expert biases) on the native backend (stacked experts assembled expert by expert over EP);
`--job TEXT` runs the jobs whose name holds TEXT.
Each rank resets its peak RSS (`/proc/self/clear_refs` 5,
Linux) after build + load and a barrier, streams in one mode dropping each bucket as it comes,
and reports `VmHWM - VmRSS before`; rank 0 prints a row per (job, mode, rank). Modes: stage and
broadcast in the checkpoint's layout, and broadcast with `layout="model"` (transformers'
in-memory tensors: experts stacked, so the largest tensor is a layer's stacked experts).

    .venv/bin/python benchmarks/stream_memory_dist.py [--hidden 1024 --bucket-mib 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

JOBS = {  # name -> (family, layout, backend, model overrides beyond the hidden size)
    "llama tp2.pp2": (
        "llama",
        "tp2pp2",
        "native",
        {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16},
    ),
    "mixtral ep2.tp2": (
        "mixtral",
        "ep2tp2",
        "native",
        {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16, "num_local_experts": 4},
    ),
    "qwen3_moe ep2.tp2 (transformers backend)": (  # a layer's 4 experts' gate/up, 128 MiB stacked: over the embedding
        "qwen3_moe",
        "ep2tp2",
        "transformers",
        {
            "num_hidden_layers": 2,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 4,
            "moe_intermediate_size": 4096,
        },
    ),
    "gpt_oss ep2.tp2": (  # native stacked experts: a layer's 4 experts' gate/up, 128 MiB, assembled over EP
        "gpt_oss",
        "ep2tp2etp1",
        "native",
        {
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_local_experts": 4,
        },
    ),
    "granitemoe ep2.tp2 (transformers backend)": (  # experts stacked in the checkpoint too: 128 MiB of gate/up
        "granitemoe",
        "ep2tp2",
        "transformers",
        {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 16, "num_local_experts": 4},
    ),
}


def _make_tiny(family: str, out: Path, **overrides) -> Path:
    """A native family's tiny model (runtime/tiny.py), or another transformers model_type's from
    runtime/hf_tiny.py's config rule (its 5M-parameter guard is for tests: sized up here)."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.tiny import HF_TINY, TINY
    from megatron_bridge.runtime import hf_tiny, tiny

    if family in TINY or family in HF_TINY:
        return tiny.make_tiny(family, out, **overrides)
    torch.manual_seed(0)
    cfg = hf_tiny.tiny_config(family, **overrides)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _worker(hf: Path, layout_text: str, backend: str, bucket: int) -> None:
    import torch
    from safetensors import safe_open

    from megatron_bridge.backends.describe import describe_hf
    from megatron_bridge.bridge.hf_config import UnsupportedFeatures, load_spec, read_hf_config
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.parity import ensure_groups
    from megatron_bridge.runtime.weights import load_hf_weights
    from megatron_bridge.stream import hf_buckets

    torch.distributed.init_process_group("gloo")
    layout = Layout.parse(layout_text)
    ensure_groups(layout, torch.distributed.get_world_size())
    specs = {  # by backend: the native families' spec, or transformers' modules (the transformers backend)
        "native": load_spec,
        "transformers": lambda p: describe_hf(
            read_hf_config(p), make_vocab_size_divisible_by=128, backend="transformers"
        ),
    }
    spec = specs[backend](hf)
    chunks = build_model(spec, layout, load_weights=True)
    load_hf_weights(chunks, spec, hf)
    largest = 0
    for f in hf.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                n = 4  # fp32 source
                for d in sl.get_shape():
                    n *= d
                largest = max(largest, n)
    rows = []
    for mode, form in (("stage", "checkpoint"), ("broadcast", "checkpoint"), ("broadcast", "model")):
        gc.collect()
        torch.distributed.barrier()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status_kib("VmRSS")
        received = biggest = 0
        try:
            for b in hf_buckets(chunks, spec, bucket_bytes=bucket, mode=mode, layout=form):
                sizes = [t.numel() * t.element_size() for _, t in b]
                received, biggest = received + sum(sizes), max([biggest, *sizes])
                del b
        except UnsupportedFeatures:  # layout="model" of a model the transformers backend cannot describe (GPT-OSS)
            continue
        peak = _status_kib("VmHWM") - base
        name = mode if form == "checkpoint" else f"{mode}, layout=model"  # model: experts stacked (fused)
        rows.append(
            {"rank": torch.distributed.get_rank(), "mode": name, "received": received, "peak_kib": peak, "big": biggest}
        )
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, rows)
    if torch.distributed.get_rank() == 0:
        print("ROWS " + json.dumps({"largest": largest, "rows": [r for rs in out for r in rs]}), flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--worker", nargs=3, metavar=("HF", "LAYOUT", "BACKEND"))
    ap.add_argument("--job", default="", help="run only the jobs whose name holds this text")
    a = ap.parse_args()
    bucket = a.bucket_mib << 20
    if a.worker:
        _worker(Path(a.worker[0]), a.worker[1], a.worker[2], bucket)
        return
    from megatron_bridge.runtime.weights_base import GATHER_CHUNK_BYTES
    from megatron_bridge.testing import free_port

    mib = 2**20
    print("| job | mode | rank | received MiB | peak RSS increase MiB | stated bound MiB |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (family, layout, backend, extra) in ((k, v) for k, v in JOBS.items() if a.job in k):
            hf = _make_tiny(
                family,
                Path(tmp) / family,
                hidden_size=a.hidden,
                intermediate_size=4 * a.hidden,
                vocab_size=32000,
                **extra,
            )
            torchrun = Path(sys.executable).parent / "torchrun"
            cmd = [str(torchrun), "--nproc-per-node", "4", "--master-port", str(free_port()), __file__]
            cmd += ["--bucket-mib", str(a.bucket_mib), "--worker", str(hf), layout, backend]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
            got = json.loads(next(line for line in out.splitlines() if line.startswith("ROWS "))[5:])
            largest = got["largest"]
            for r in sorted(got["rows"], key=lambda r: (r["mode"], r["rank"])):
                big = max(largest, r["big"])  # layout=model: a layer's stacked experts can be the largest
                bound = max(bucket, big) + big + GATHER_CHUNK_BYTES
                print(
                    f"| {name} | {r['mode']} | {r['rank']} | {r['received'] / mib:.0f} | "
                    f"+{r['peak_kib'] / 1024:.0f} | {bound / mib:.0f} |"
                )


if __name__ == "__main__":
    main()
