"""The transformers backend under real multi-process layouts: one torchrun launch (4 processes, gloo).

transformers' own modeling code for the sample architectures (bridge/tiny.py `HF_TINY`, each
with its distinctive features on: Cohere's per-head qk norm, logit scale, parallel block and
tied embeddings; GPT-NeoX's fused per-head query_key_value and renamed head; Qwen3's and
EXAONE-4's replicated q/k norms; Phi's unplanned q/k LayerNorm and biased head; OLMo-3's
gathered q/k/v; StarCoder2's sliding window, biases and tied embeddings) and Llama forced onto
the transformers backend, at tp2, tp2·pp2 and pp2·vpp2 (two of them at tp2·cp2), and Qwen3-MoE at ep2, ep2·pp2 and ep2·tp2, and a
sample with sequence parallelism (`SP`, Llama 4's transposed experts among them): logits within 1e-5 (fp32) of transformers', the
loss and every gradient, the bit-exact export round trip, and the exported directory loads in
transformers with the oracle's logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_bridge.bridge.tiny import HF_TINY
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = str(Path(__file__).parent / "bridge_scripts" / "parity.py")
# a sample of the architectures the override table (backends/transformers/overrides.py OVERRIDES) lifted, from
# runtime/hf_tiny.py, at tp2pp2 only (the full matrix: `mbr verify --matrix model.backend=transformers`):
# Gemma-2's scaled embedding module and logit softcap, Granite's embedding multiplier and logit
# divisor, NanoChat's stage pieces (no pp plan; a weightless norm before and after the layers),
# Apertus' 0-dim xIELU buffers (loaded whole, exported), Cohere-Compass' rotary-free layer kind,
# MiniCPM3's multi-head latent attention (`mla_kv_a_proj`, a 4-D input to a column-parallel linear),
# DeepSeek-V3.2's sparse attention (`indexed_attention`: a whole indexer's top-k of 8 keys out of 16
# narrowing the mask of the split MLA heads; MoE experts split over TP; its gradients with sequence
# parallelism, as MoE at tp > 1 trains, the indexed layers run whole: plan.sp_whole); Qwen3.5's gated DeltaNet
# layers (linear attention run whole on every TP rank) beside full attention; Falcon's plan from the
# override table alone (multi-query: `mqa_fused_qkv`, the one K/V head whole on every rank; layers `h`)
MATRIX_SAMPLE = [
    "gemma2", "granite", "nanochat", "apertus", "cohere_compass_text", "minicpm3", "deepseek_v32", "qwen3_5_text",
    "falcon",
]  # fmt: skip
# Qwen3-MoE forced onto the transformers backend (a dense layer among MoE layers, top-k renormalised):
# transformers' experts module over the EP group (runtime/transformers/experts.py) at ep2 (with dp2: the
# expert gradients reduced over the expert-data-parallel group), ep2·pp2 and ep2·tp2 (experts
# split over TP as `moe_tp_experts`, tokens whole on every TP rank); ep layouts run
# for MoE models only (bridge_scripts/parity.py), and its dense layouts are skipped here
MOE = ["qwen3_moe"]
# Llama 4's experts, stored transposed (`packed_rowwise` gate_up_proj [E, H, 2·I], `colwise`
# down_proj) and called on pre-scaled tokens alone (runtime/transformers/experts.py
# PrescaledExpertsSequenceTP inside PrescaledExpertsEP's fixed exchange), at ep2·tp2 with sequence
# parallelism only: a runtime/hf_tiny.py config with every layer full attention, so every layer
# splits (chunked-attention layers run whole under SP, plan.sp_whole: the matrix's released mix)
VARIANTS = {"llama4_text": {"no_rope_layers": [0] * 4, "layer_types": ["full_attention"] * 4}}
FAMILIES = ["llama", *HF_TINY, *MATRIX_SAMPLE, *MOE, *VARIANTS]
# (pp2 alone is not here: tp2·pp2 and pp2·vpp2 stage the same pieces; CI time)
DENSE_LAYOUTS = ["tp2", "tp2pp2", "pp2vpp2"]
# context parallelism (runtime/transformers/cp.py: K/V gathered around the model's own attention, masks from
# global positions) at tp2·cp2 for both inner attention functions: transformers' SDPA (StarCoder2's
# sliding window, biases, tied embeddings) and the model's own eager one (Gemma-2: logit
# soft-capping, alternating sliding layers)
CP = ["starcoder2", "gemma2"]
# sequence parallelism (runtime/transformers/layers.py: hidden states [b, s/tp, h] between the gathered
# attention / MLP modules, norms' gradients summed over TP): Qwen3 (replicated q/k norms) at
# tp2, Llama at tp2·pp2 (the [s/tp, b, h] stage boundary), Qwen3-MoE at ep2·tp2 (tokens
# gathered into the TP-split experts; its ep2tp2 gradients already run with SP)
SP = {"qwen3": ["tp2sp"], "llama": ["tp2pp2sp"], "qwen3_moe": ["ep2tp2sp"], "llama4_text": ["ep2tp2sp"]}
SP_LAYOUTS = ["tp2sp", "tp2pp2sp", "ep2tp2sp"]
LAYOUTS = [*DENSE_LAYOUTS, "tp2cp2", "ep2", "ep2pp2", "ep2tp2", *SP_LAYOUTS]
SKIP = [f"{fam}/{lay}" for fam in MATRIX_SAMPLE for lay in DENSE_LAYOUTS if lay != "tp2pp2"]
SKIP += [f"{fam}/{lay}" for fam in MOE for lay in DENSE_LAYOUTS]
SKIP += [f"{fam}/tp2cp2" for fam in FAMILIES if fam not in CP]
SKIP += [f"{fam}/{lay}" for fam in FAMILIES for lay in SP_LAYOUTS if lay not in SP.get(fam, ())]
SKIP += [f"{fam}/{lay}" for fam in VARIANTS for lay in LAYOUTS if lay not in SP[fam] and f"{fam}/{lay}" not in SKIP]
TOL = 1e-5


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from megatron_bridge.runtime import hf_tiny
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.runtime.tiny import make_tiny

    base = tmp_path_factory.mktemp("hf_backend")
    (base / "refs").mkdir()
    ids, labels = make_batch(250)
    for fam in FAMILIES:
        if fam in MATRIX_SAMPLE or fam in VARIANTS:
            path = hf_tiny.make_tiny(fam, base / fam, **VARIANTS.get(fam, {}))
        else:
            path = make_tiny(fam, base / fam)
        torch.save(dict(input_ids=ids, labels=labels, **hf_reference(path, ids, labels)), base / "refs" / f"{fam}.pt")
    return base


def test_hf_backend_tp2_pp2_tp2pp2_vpp_equal_transformers(root, tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_bridge.runtime.parity import fold

    per_rank = run_torchrun(
        [SCRIPT, "--root", str(root), "--families", ",".join(FAMILIES), "--layouts", ",".join(LAYOUTS),
         "--checks", "logits,grads,roundtrip", "--out", str(tmp_path), "--backend", "transformers",
         "--skip", ",".join(SKIP)],
        nproc=4, timeout=600,
    )  # fmt: skip
    failures = []
    for fam in FAMILIES:
        ref = torch.load(root / "refs" / f"{fam}.pt")
        for layout in LAYOUTS:
            if f"{fam}/{layout}" in SKIP or layout.startswith("ep") and fam not in (*MOE, *VARIANTS):
                continue
            f = fold(per_rank, f"{fam}/{layout}", ref)
            if f is None:
                failures.append(f"{fam}/{layout}: no rank reported")
                continue
            if not f.get("logits_max", 1.0) < TOL:
                failures.append(f"{fam}/{layout}: logits {f.get('logits_max')}")
            if not f.get("loss_delta", 1.0) < TOL:
                failures.append(f"{fam}/{layout}: loss {f.get('loss')} vs {ref['loss']}")
            if f.get("grads_n") != len(ref["grads"]) or f["grads_bad"] or not f["grads_max"] < TOL:
                failures.append(f"{fam}/{layout}: grads {f.get('grads_n')}/{len(ref['grads'])} {f.get('grads_max')}")
            if not (f.get("rt_ok") and f["rt_n"] == len(ref["grads"])):
                failures.append(f"{fam}/{layout}: round trip {f.get('rt_bad')}")
    assert not failures, failures
    for fam in ("cohere", "gpt_neox"):  # tied embeddings; a head transformers saves under another name
        ref = torch.load(root / "refs" / f"{fam}.pt")
        export = tmp_path / fam / "tp2pp2" / "roundtrip"
        model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
        with torch.no_grad():
            assert (model(ref["input_ids"]).logits - ref["logits"]).abs().max() < TOL
