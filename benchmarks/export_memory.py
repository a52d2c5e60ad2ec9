"""Peak host memory of handing a model's weights out, one process, a Llama-shaped fp32 model:
`export_hf_weights` (streamed, tensor by tensor), the former writer (`save_file` of every
gathered tensor held at once), an interval export written behind the loop (`start_hf_export`
with a `--bucket-mib` queue, runtime/hf_export.py) and the RL weight stream
(`megatron_bridge.stream.hf_buckets`, buckets of `--bucket-mib`, each dropped once received).
Each way runs in its own process; the number is that process's peak RSS increase over its RSS
after build + load (`ru_maxrss`), so the model itself is not counted; the bound printed is the
one the docs state (bucket + largest tensor).

    .venv/bin/python benchmarks/export_memory.py [--layers 4 --hidden 1024 --bucket-mib 64]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _one(way: str, hf: Path, out: Path, bucket: int) -> None:
    from safetensors.torch import save_file

    from megatron_bridge.bridge.hf_config import load_spec
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.weights import export_hf_weights, iter_hf_tensors, load_hf_weights, start_hf_export
    from megatron_bridge.stream import hf_buckets
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        spec = load_spec(hf)
        chunks = build_model(spec, Layout(), load_weights=True)
        load_hf_weights(chunks, spec, hf)
        base = _peak_mib()
        t0 = time.perf_counter()
        largest = max(p.numel() * p.element_size() for c in chunks for p in c.parameters()) / 2**20
        bound = ""
        if way == "streamed":
            export_hf_weights(chunks, spec, out, source_dir=hf)
        elif way == "behind":
            start_hf_export(chunks, spec, out, source_dir=hf, buffer_bytes=bucket).finish()
            bound = f" (bound: queue {bucket / 2**20:.0f} + largest {largest:.0f} MiB)"
        elif way == "stream":
            out.mkdir()
            n = sum(len(b) for b in hf_buckets(chunks, spec, bucket_bytes=bucket))
            (out / "n").write_text(str(n))
            bound = f" (bound: bucket {bucket / 2**20:.0f} + largest {largest:.0f} MiB)"
        else:
            out.mkdir()
            save_file(dict(iter_hf_tensors(chunks, spec)), str(out / "model.safetensors"), metadata={"format": "pt"})
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        print(
            f"{way}: file {size / 2**20:.0f} MiB, peak RSS +{_peak_mib() - base:.0f} MiB{bound}, "
            f"{time.perf_counter() - t0:.1f} s"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--way", choices=["streamed", "held", "behind", "stream"])
    ap.add_argument("--hf")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.way:
        _one(a.way, Path(a.hf), Path(a.out), a.bucket_mib << 20)
        return
    from megatron_bridge.runtime.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        hf = make_tiny(
            "llama", Path(tmp) / "hf", hidden_size=a.hidden, intermediate_size=4 * a.hidden,
            num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
        )  # fmt: skip
        for way in ("streamed", "held", "behind", "stream"):
            cmd = [sys.executable, __file__, "--way", way, "--hf", str(hf), "--out", str(Path(tmp) / way)]
            cmd += ["--bucket-mib", str(a.bucket_mib)]
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
