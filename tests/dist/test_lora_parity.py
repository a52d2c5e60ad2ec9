"""LoRA on megatron equals HF PEFT on transformers (one torchrun launch, 4 gloo processes).

HF PEFT is the oracle. For each tiny model an adapter is made with `peft.get_peft_model`
(B drawn non-zero, so A's gradients are not trivially zero) and saved with
`save_pretrained`; peft's fp32 loss and adapter gradients on a fixed batch are the
reference. The launch starts megatron from that adapter (`peft.init_from`) at tp2 (dp2),
tp2 with sequence parallelism, pp2 (dp2), tp2·pp2 and ep2 (MoE, attention adapters) and
checks, per layout:

* loss and every adapter gradient (gathered back to HF PEFT's names and shapes through the
  bridge's transforms) equal peft's;
* base weights frozen, adapters trainable;
* after a few SGD steps, the exported adapter loaded by `PeftModel.from_pretrained` onto the
  base, the merged export loaded by transformers, and megatron itself give the same logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = str(Path(__file__).parent / "bridge_scripts" / "lora_parity.py")
RANK, ALPHA = 4, 8.0
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],  # transformers 5 fuses the experts
}
LAYOUTS = ["tp2", "tp2sp", "pp2", "tp2pp2", "ep2"]
TOL = 1e-5
LOGIT_TOL = 1e-4


def _strip(name: str) -> str:
    return name.replace(".default.", ".")


def _peft_reference(hf_dir: Path, adapter_dir: Path, family: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megatron_bridge.bridge.parity import make_batch

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS[family]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(str(adapter_dir))
    ids, labels = make_batch(250)
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    grads = {f"{_strip(n)}": p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_with_grad
    return dict(input_ids=ids, labels=labels, loss=float(loss), grads=grads, targets=TARGETS[family],
                rank=RANK, alpha=ALPHA)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from megatron_bridge.bridge.tiny import make_tiny

    root = tmp_path_factory.mktemp("lora")
    (root / "refs").mkdir()
    for fam in TARGETS:
        path = make_tiny(fam, root / fam)
        ref = _peft_reference(path, root / "adapters" / fam, fam)
        torch.save(ref, root / "refs" / f"{fam}.pt")
    out = root / "out"
    results = run_torchrun(
        [SCRIPT, "--root", str(root), "--families", ",".join(TARGETS), "--layouts", ",".join(LAYOUTS),
         "--out", str(out)],
        nproc=4, timeout=1200,
    )
    merged: dict = {}
    for rank_result in results:
        for key, value in rank_result.items():
            merged.setdefault(key, []).append(value)
    return root, out, merged


def _cases():
    return [(f, lay) for lay in LAYOUTS for f in TARGETS if not (lay.startswith("ep") and f == "llama")]


@pytest.mark.parametrize("family,layout", _cases())
def test_loss_and_adapter_grads_equal_peft(launch, family, layout):
    root, _, merged = launch
    ref = torch.load(root / "refs" / f"{family}.pt")
    per_rank = merged[f"{family}/{layout}"]
    losses = [r["loss"] for r in per_rank if "loss" in r]
    assert losses and max(abs(v - ref["loss"]) for v in losses) <= TOL, (losses, ref["loss"])
    reports = [r["grads"] for r in per_rank]
    assert not [b for g in reports for b in g["bad"]]
    got = sorted(k for g in reports for k in g["keys"])
    assert got == sorted(ref["grads"]), "every adapter tensor exactly once, in HF PEFT's names"
    assert max(g["max_abs"] for g in reports) <= TOL
    assert not [b for r in per_rank for b in r["frozen_bad"]], "base frozen, adapters trainable"


@pytest.mark.parametrize("family,layout", _cases())
def test_trained_adapter_and_merged_export_match_megatron(launch, family, layout):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, out, merged = launch
    ref = torch.load(root / "refs" / f"{family}.pt")
    per_rank = merged[f"{family}/{layout}"]
    mine = torch.tensor(next(r["logits"] for r in per_rank if "logits" in r))
    adapter = out / family / layout / "adapter"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["r"] == RANK and conf["lora_alpha"] == ALPHA and conf["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(str(root / family), dtype=torch.float32)
    with torch.no_grad():
        peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(ref["input_ids"]).logits
        full = AutoModelForCausalLM.from_pretrained(str(out / family / layout / "merged"), dtype=torch.float32)
        merged_logits = full.eval()(ref["input_ids"]).logits
        untrained = AutoModelForCausalLM.from_pretrained(str(root / family), dtype=torch.float32)(ref["input_ids"])
    assert float((peft_logits - merged_logits).abs().max()) <= LOGIT_TOL
    assert float((peft_logits - mine).abs().max()) <= LOGIT_TOL
    assert float((untrained.logits - mine).abs().max()) > 1e-2, "training moved the adapters"
