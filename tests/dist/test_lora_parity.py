"""LoRA on megatron equals HF PEFT on transformers (one torchrun launch, 4 gloo processes).

HF PEFT is the oracle. For Llama (all seven linears) and Qwen2-MoE (attention) an adapter
is made with `peft.get_peft_model` (B drawn non-zero, so A's gradients are not trivially
zero) and saved with `save_pretrained`; peft's fp32 loss and adapter gradients on a fixed
batch are the reference. Mixtral's expert adapters (w1/w2/w3) have no HF PEFT counterpart
under transformers 5 (fused experts): their oracle is transformers on the merged weights.
The launch starts megatron from that adapter (`peft.init_from`) at tp2, tp2+SP, pp2,
tp2·pp2, pp2·vpp2, cp2·tp2, ep2 and ep2·tp2·etp1+SP (expert adapters need etp=1) and
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
    "qwen2_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    # transformers 5 keeps experts fused in memory, which HF PEFT adapts through
    # target_parameters: the expert adapters' oracle is transformers on the merged weights
    "mixtral": ["q_proj", "o_proj", "w1", "w2", "w3"],
}
NO_PEFT = {"mixtral"}
LAYOUTS = ["tp2", "tp2sp", "pp2", "tp2pp2", "pp2vpp2", "cp2tp2", "ep2", "ep2tp2etp1sp"]
SKIP = {("mixtral", "tp2"), ("mixtral", "tp2sp"), ("mixtral", "tp2pp2"), ("mixtral", "cp2tp2")}  # expert LoRA: etp=1
TOL = 1e-5
LOGIT_TOL = 1e-4


def _strip(name: str) -> str:
    return name.replace(".default.", ".")


def _peft_reference(hf_dir: Path, adapter_dir: Path, family: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from megatron_bridge.runtime.parity import make_batch

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
    return dict(
        input_ids=ids, labels=labels, loss=float(loss), grads=grads, targets=TARGETS[family], rank=RANK, alpha=ALPHA
    )


def _merged_reference(hf_dir: Path, adapter_dir: Path, family: str) -> dict:
    """Without peft: random (A, B) for every targeted module of the checkpoint, written as an
    HF PEFT adapter; the oracle is transformers on W + alpha/r·B A, whose weight gradient G
    gives the adapters' (dL/dA = alpha/r·Bᵀ G, dL/dB = alpha/r·G Aᵀ)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_bridge.bridge.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, matches, peft_key
    from megatron_bridge.runtime.parity import hf_reference, make_batch
    from megatron_bridge.config.schema import PeftConfig

    peft = PeftConfig(method="lora", rank=RANK, alpha=ALPHA, target_modules=TARGETS[family])
    scale, g = ALPHA / RANK, torch.Generator().manual_seed(2)
    merged_dir = hf_dir.parent / f"{family}_merged"
    shutil.copytree(hf_dir, merged_dir)
    (weights_file,) = merged_dir.glob("*.safetensors")
    weights, adapter = load_file(str(weights_file)), {}
    for name, w in weights.items():
        if name.endswith(".weight") and any(matches(name[: -len(".weight")], t) for t in TARGETS[family]):
            a, b = torch.randn(RANK, w.shape[1], generator=g) * 0.2, torch.randn(w.shape[0], RANK, generator=g) * 0.2
            adapter[peft_key(name, "A")], adapter[peft_key(name, "B")] = a, b
            weights[name] = w + scale * b @ a
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    adapter_dir.mkdir(parents=True)
    save_file(adapter, str(adapter_dir / ADAPTER_WEIGHTS))
    (adapter_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(peft, str(hf_dir))))
    ids, labels = make_batch(250)
    ref = hf_reference(merged_dir, ids, labels)
    grads = {}
    for name, gw in ref["grads"].items():
        ka, kb = peft_key(name, "A"), peft_key(name, "B")
        if ka in adapter:
            grads[ka], grads[kb] = scale * adapter[kb].T @ gw, scale * gw @ adapter[ka].T
    return dict(
        input_ids=ids, labels=labels, loss=ref["loss"], grads=grads, targets=TARGETS[family], rank=RANK, alpha=ALPHA
    )


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    from megatron_bridge.runtime.tiny import make_tiny

    root = tmp_path_factory.mktemp("lora")
    (root / "refs").mkdir()
    for fam in TARGETS:
        path = make_tiny(fam, root / fam)
        make_ref = _merged_reference if fam in NO_PEFT else _peft_reference
        ref = make_ref(path, root / "adapters" / fam, fam)
        torch.save(ref, root / "refs" / f"{fam}.pt")
    out = root / "out"
    results = run_torchrun(
        [
            SCRIPT,
            "--root",
            str(root),
            "--families",
            ",".join(TARGETS),
            "--layouts",
            ",".join(LAYOUTS),
            "--out",
            str(out),
            "--skip",
            ",".join(f"{f}/{lay}" for f, lay in sorted(SKIP)),
        ],
        nproc=4,
        timeout=1200,
    )
    merged: dict = {}
    for rank_result in results:
        for key, value in rank_result.items():
            merged.setdefault(key, []).append(value)
    return root, out, merged


def _cases():
    return [
        (f, lay)
        for lay in LAYOUTS
        for f in TARGETS
        if not (lay.startswith("ep") and f == "llama") and (f, lay) not in SKIP
    ]


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
    with torch.no_grad():
        full = AutoModelForCausalLM.from_pretrained(str(out / family / layout / "merged"), dtype=torch.float32)
        merged_logits = full.eval()(ref["input_ids"]).logits
        untrained = AutoModelForCausalLM.from_pretrained(str(root / family), dtype=torch.float32)(ref["input_ids"])
        if family not in NO_PEFT:
            base = AutoModelForCausalLM.from_pretrained(str(root / family), dtype=torch.float32)
            peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(ref["input_ids"]).logits
            assert float((peft_logits - merged_logits).abs().max()) <= LOGIT_TOL
    assert float((merged_logits - mine).abs().max()) <= LOGIT_TOL
    assert float((untrained.logits - mine).abs().max()) > 1e-2, "training moved the adapters"
    # megatron_bridge.stream's adapter stream: the exported adapter's tensors under the same peft
    # keys, bit for bit; per stage once over the receiving ranks, broadcast on every rank
    from safetensors.torch import load_file

    keys = sorted(load_file(str(adapter / "adapter_model.safetensors")))
    streams = [r["stream"] for r in per_rank]
    assert all(m["equal"] for s in streams for m in s.values())
    assert sorted(k for s in streams for k in s["stage"]["keys"]) == keys
    assert all(s["broadcast"]["keys"] == keys for s in streams)  # ep layouts too: experts' gathered over EP
