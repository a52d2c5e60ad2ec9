"""The GPU kit's CPU dry run (benchmarks/gpu/kit.py --smoke), so the script a lent GPU machine
runs first cannot rot between GPU sessions: the same code, small shapes, on gloo — the device
probe, the resume check (its three training launches and the kit's parsing of their
losses), the SDPA kernel probe, the `llama8b` pairs (eager, compiled — `train.compile=true`
against the bare loop with its layers compiled alike, 1 layer: inductor compiles slowly on CPU —
and eager with `train.fused`) at a tiny shape with the 8B check's GQA, ffn, vocabulary and recompute knobs,
the fused pair with float8 GEMMs (`fp8`: its ratio to bf16 parsed) and the loss-curve check,
the MoE pair (`moe`: Qwen3-30B-A3B-shaped knobs, tiny) and the all-layers run (`llama8b32`: ours,
fused, chunked loss; compiled too on a GPU) and the transformers backend against native on the 8B knobs
(`hf8b`, full recompute on both). Left out for CI time: `verify` (its `mbr verify` runs are tested in
test_bridge_verify_e2e.py), `resume_ds` (`resume`'s code with DeepSpeed's engine, trained and
resumed in test_train.py), `compile` (the `overhead` loop with `--compile`: llama8b_compiled runs
that code), and `overhead` / `hfspeed` (two launches each of
benchmarks/train_overhead.py and benchmarks/hf_vs_native.py, whose output the kit only tails
and parses for one number; run `python benchmarks/gpu/kit.py --smoke --out DIR` before
spending device time)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_kit_smoke_probes_and_resumes_on_cpu(tmp_path):
    cmd = [
        sys.executable,
        "benchmarks/gpu/kit.py",
        "--smoke",
        "--only",
        "env,resume,sdpa,llama8b,fp8,moe,llama8b32,hf8b",
        "--out",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "gpu_report.md").read_text()
    heads = {line.split(" ")[1]: line for line in report.splitlines() if line.startswith("- ")}
    assert '"cuda": null' in heads["env:"], report  # the probe ran
    assert f'"megatron.core": "{importlib.metadata.version("megatron-core")}"' in heads["env:"], report
    assert heads["resume:"].endswith("max |diff| = 0 (bit-exact)"), report  # steps 4-6 resumed exactly
    assert "sdpa by head dim: rc=0" in report and "head_dim 512 heads 2 kv 1: eager vs sdpa" in report, report
    # the 8B-shaped pair (GQA, SwiGLU ffn, a large vocabulary, full recompute), eager and compiled
    assert "both compiled" in report and "step time ratio (ours / bare)" in report, report
    for name in ("llama8b", "llama8b_compiled", "llama8b_fused"):
        assert "rc=0" in heads[name] and heads[f"{name}:"].count("tokens/s") == 2, report
    # the same with float8 GEMMs, their tokens/s over the bf16 pair's, and the bf16-vs-fp8 loss curve
    assert report.count("both fused") == 2, report  # llama8b_fused and llama8b_fused_fp8
    for name in ("llama8b_fused_fp8",):
        assert "rc=0" in heads[name] and heads[f"{name}:"].count("tokens/s") == 2, report
        assert f"- speed-up {name}: " in report, report  # its tokens/s over the bf16 pair's
    assert report.count("both fp8 (tensorwise)") == 1, report
    assert heads["fp8"].startswith("- fp8 curve (10 steps,") and "largest step |diff|" in heads["fp8"], report
    # the MoE pair (experts, top-k, head dim): ours and the bare loop
    assert "rc=0" in heads["moe"] and "experts=8 top-2" in report and heads["moe:"].count("tokens/s") == 2, report
    assert "median step" in heads["llama8b_32"] and "MFU" in heads["llama8b_32"], report
    assert "rc=0" in heads["hf8b"] and "step time ratio (transformers / native)" in report, report
