"""`mbr verify` of vision-language models against transformers, with images (one launch of the VLM
matrix over four of them): logits, loss, every gradient (vision tower included) and the bit-exact
HF round trip at tp2, pp2 and tp2·pp2, and ep2·tp2·sp for the MoE ones; `mbr convert` to torch_dist
and to per-rank files, `mbr export` back, bit for bit. Qwen3-VL adds deepstack features after its
first layer, Qwen3-VL-MoE holds its experts stacked (saved either way round), Gemma 3 attends
bidirectionally within an image, Llama 4's VLM forward holds a causal LM with its own head."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.dist


def test_vlm_matrix_rows_pass(tmp_path):
    cmd = [
        sys.executable, "-m", "megatron_bridge.cli", "verify", "--matrix", "model.backend=transformers",
        "verify.vlm=true", "verify.families=[qwen3_vl,qwen3_vl_moe,gemma3,llama4]",
        "verify.layouts=[tp2,pp2,tp2pp2,ep2tp2sp]", f"verify.out={tmp_path}",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ") and not ln.startswith("| architecture")]
    verdicts = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.rsplit("|", 2)[-2].strip() for ln in rows}
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    want = {(a, t) for a in ("qwen3_vl", "qwen3_vl_moe", "gemma3", "llama4") for t in ("tp2", "pp2", "tp2pp2")}
    want |= {("qwen3_vl_moe", "ep2tp2sp"), ("llama4", "ep2tp2sp")}
    assert set(verdicts) == want and set(verdicts.values()) == {"pass"}, verdicts
