"""A random GPT-OSS checkpoint with GPT-OSS-120B's expert widths, for converter measurements.

    python benchmarks/make_gpt_oss_wide.py DIR EXPERTS    # hidden 2880, inter 2880, 1 layer, bf16

The tiny test model's config (bridge/tiny.py) widened to hidden 2880 / intermediate 2880 with
EXPERTS experts in one layer (4: 0.21 GB, 16: 0.81 GB), written by transformers'
save_pretrained: `gate_up_proj` [E, 2880, 5760] stacked and transposed, as the real model
stores it (after MXFP4 dequantisation). docs/benchmarks.md, "Stacked experts".
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_bridge.runtime.tiny import make_tiny

d, experts = Path(sys.argv[1]), int(sys.argv[2])
make_tiny("gpt_oss", d)
cfg = json.loads((d / "config.json").read_text())
cfg.update(
    hidden_size=2880,
    intermediate_size=2880,
    num_local_experts=experts,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    layer_types=["full_attention"],
    dtype="bfloat16",
)
(d / "config.json").write_text(json.dumps(cfg))
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.bfloat16)
model.save_pretrained(d)
