"""`mbr verify` end to end: it starts its own local torchrun processes and reports per layout."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def test_verify_tiny_moe_model_across_layouts(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "megatron_bridge.cli",
        "verify",
        "verify.tiny=qwen2_moe",
        f"verify.out={tmp_path}",
        "verify.layouts=[tp2,ep2]",
        "verify.checks=[logits,roundtrip,grads]",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-5000:]
    assert "running 2 layout(s) on 2 local process(es)" in out
    for layout in ("tp2·pp1·cp1·ep1", "tp1·pp1·cp1·ep2"):
        assert f"layout {layout}" in out
    assert out.count("round trip  93 tensors bit-exact  OK") == 2
    assert out.count("grads       93/93 tensors") == 2 and "all layouts OK" in out
    assert (tmp_path / "tp2pp1cp1ep1" / "roundtrip" / "model.safetensors.index.json").is_file()
