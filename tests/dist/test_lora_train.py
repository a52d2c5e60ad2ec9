"""`peft=lora` through the training entry point (one torchrun launch, 4 gloo processes).

Jobs, all from the same tiny HF Llama and the same synthetic batches:
* `full`: tp2·pp2, ZeRO-1 (megatron's DistributedOptimizer), 6 steps, then
  `export_adapter_to` and `export_to`;
* `first3` + `resumed`: the same run stopped after 3 steps and resumed from its checkpoint —
  the losses must equal `full`'s bit for bit, and the checkpoint holds adapters only (plus
  their optimizer state) and names its base model;
* `ds`: DeepSpeed ZeRO-2 at tp2 (dp2): same losses as `full` (reduction order only differs);
* `hf`: the same model on the transformers backend (transformers' modules, megatron's parallel linears)
  at tp2 (dp2), 2 steps: step 1 (B = 0, so the peft model's loss is the base's) equals
  `full`'s; its adapter, on transformers' module names, exported after step 2.
Each exported adapter, loaded by HF PEFT onto the base, gives its merged export's logits;
`mbr export adapter=true` from the resumed run's checkpoint writes the same adapter.
"""

import json

import pytest
import torch

from megatron_bridge.runtime.tiny import make_tiny
from megatron_bridge.testing import run_torchrun

pytestmark = pytest.mark.dist
SCRIPT = "tests/dist/train_scripts/layouts.py"
REL = 2e-5


def test_lora_training_resume_export_and_deepspeed(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = make_tiny("llama", tmp_path / "llama")
    ck, runs = tmp_path / "ckpt", tmp_path / "runs"
    common = ",".join(
        [
            "recipe=default",
            f"model.hf_path={hf}",
            "train.steps=6",
            "train.seq_length=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "optimizer.warmup_steps=2",
            "optimizer.lr=1e-2",
            "data=synthetic",
            "peft=lora",
        ]
    )
    mg = f"{common},parallel.tp=2,parallel.pp=2,zero.stage=1"
    jobs = [
        f"full:{mg},export_adapter_to={tmp_path / 'adapter'},export_to={tmp_path / 'merged'}",
        f"first3:{mg},train.exit_after=3,checkpoint.dir={ck},checkpoint.save_interval=3",
        f"resumed:{mg},checkpoint.dir={ck},checkpoint.resume=true",
        f"ds:{common},parallel.tp=2,train.engine=deepspeed,zero.stage=2",
        f"hf:{common},train.steps=2,model.backend=transformers,parallel.tp=2,"  # 2 steps: CI time
        f"export_adapter_to={tmp_path / 'hf_adapter'},export_to={tmp_path / 'hf_merged'}",
    ]
    losses = run_torchrun([SCRIPT, str(runs), *jobs], nproc=4, timeout=900)[0]["losses"]
    full = losses["full"]
    assert full["6"] < full["1"]
    assert losses["first3"] == {k: full[k] for k in ("1", "2", "3")}
    assert losses["resumed"] == {k: full[k] for k in ("4", "5", "6")}  # bit-exact resume
    for step, value in losses["ds"].items():
        assert abs(value - full[step]) <= REL * abs(full[step]), (step, value, full[step])
    assert abs(losses["hf"]["1"] - full["1"]) <= REL * abs(full["1"]), (losses["hf"]["1"], full["1"])

    state = torch.load(ck / "iter_0000006" / "rank_00000.pt", weights_only=False)
    keys = [k for chunk in state["engine"]["model"] for k in chunk]
    assert keys and all(".lora." in k for k in keys), "a LoRA checkpoint holds the adapters only"
    manifest = json.loads((ck / "iter_0000006" / "manifest.json").read_text())
    assert manifest["base"] == str(hf) and manifest["peft"].startswith("lora r=8")

    # `mbr export adapter=true` from the checkpoint: the adapter the run exported, byte for byte
    from megatron_bridge.commands.export import main as export_main

    assert export_main([f"src={ck}", f"dst={tmp_path / 'from_ckpt'}", "adapter=true"]) == 0
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "from_ckpt" / name).read_bytes() == (tmp_path / "adapter" / name).read_bytes()

    ids = torch.randint(0, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    for adapter, merged_dir, tol in (("adapter", "merged", 1e-4), ("hf_adapter", "hf_merged", 1e-5)):
        with torch.no_grad():
            base = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
            base_logits = base(ids).logits
            peft_logits = PeftModel.from_pretrained(base, str(tmp_path / adapter)).eval()(ids).logits
            merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / merged_dir), dtype=torch.float32).eval()
            merged_logits = merged(ids).logits
        assert float((peft_logits - merged_logits).abs().max()) <= tol, adapter
        assert float((peft_logits - base_logits).abs().max()) > 1e-3, f"{adapter}: the adapter was trained"
