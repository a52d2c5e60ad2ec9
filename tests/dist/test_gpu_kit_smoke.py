"""The GPU kit's CPU dry run (benchmarks/gpu/kit.py --smoke), so the script a lent GPU machine
runs first cannot rot between GPU sessions: the same checks, small shapes, on gloo. `verify`
is left out here (its `mbr verify` runs are tested in test_bridge_verify_e2e.py), and so are
`resume_ds` (`resume`'s code with DeepSpeed's engine, trained and resumed in test_train.py) and
`hfspeed` (its script only tails benchmarks/hf_vs_native.py: 2 launches of CI time for no
parsing); the kit's own parsing of each check's output is what this proves, with the training
launches it makes."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_kit_smoke_runs_every_check_on_cpu(tmp_path):
    cmd = [
        sys.executable,
        "benchmarks/gpu/kit.py",
        "--smoke",
        "--only",
        "env,resume,overhead",
        "--out",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (tmp_path / "gpu_report.md").read_text()
    heads = {line.split(" ")[1]: line for line in report.splitlines() if line.startswith("- ")}
    assert '"cuda": null' in heads["env:"], report  # the probe ran
    assert heads["resume:"].endswith("max |diff| = 0 (bit-exact)"), report  # steps 4-6 resumed exactly
    assert " rc=0 " in heads["overhead"], report  # the launches of both sides finished
    assert "step time ratio (ours / bare)" in report and "MFU" in report, report
