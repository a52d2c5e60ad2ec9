"""Tiny FP8 block-quantised checkpoints, made like the hub's DeepSeek-V3 / Kimi-K2 ones (tests).

`quantize_fp8(src, dst)` copies a saved HF model and stores every linear layer's 2-D weight
as `float8_e4m3fn` with a `weight_scale_inv` per 128 x 128 block (partial blocks at the edges
when a dimension is not a multiple of 128), the way DeepSeek's own quantiser does:
`scale_inv = amax(|block|) / 448`, `w8 = (w / scale_inv)` clamped to +-448 and cast; the
embedding, the output layer, norms and routers stay as saved. config.json gets the hub's
`quantization_config`. As on the hub (deepseek-ai/DeepSeek-V3), a multi-token-prediction
layer's decoder linears are fp8 but its `eh_proj`, `embed_tokens` and `shared_head.head`
stay bf16, and `e_score_correction_bias` stays fp32.
"""

from __future__ import annotations

import json
import shutil
from math import ceil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from megatron_bridge.bridge.hf_config import read_hf_config

FP8_MAX = 448.0
BLOCK = (128, 128)
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(BLOCK),
}
# not quantised: not nn.Linear layers of the blocks, or (eh_proj, shared_head.head) bf16 on the hub
_KEEP = ("embed_tokens", "lm_head", "norm", ".gate.weight", "router", ".eh_proj.", ".shared_head.head.")
_FP32 = ("e_score_correction_bias",)  # stored fp32 on the hub (transformers keeps it fp32 too)


def is_quantized_name(name: str, ndim: int) -> bool:
    return ndim == 2 and name.endswith(".weight") and not any(k in name for k in _KEEP)


def quantize_block_fp8(w, block: tuple[int, int] = BLOCK):
    """(fp8 weight, fp32 scale_inv grid) of a 2-D tensor."""
    rows, cols = w.shape
    bm, bn = block
    w = w.float()
    scale = torch.ones(ceil(rows / bm), ceil(cols / bn))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            amax = blk.abs().max()
            s = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8(src: str | Path, dst: str | Path, dtype: str = "bfloat16") -> Path:
    """`src` (a saved HF model) re-saved at `dst` as an FP8 block-quantised checkpoint; the
    unquantised tensors are stored as `dtype` (the hub checkpoints keep them in bf16)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(f).items():
            if is_quantized_name(name, t.dim()):
                out[name], out[name + "_scale_inv"] = quantize_block_fp8(t)
            else:
                to = torch.float32 if any(k in name for k in _FP32) else getattr(torch, dtype)
                out[name] = t.to(to) if t.is_floating_point() else t
        save_file(out, dst / f.name, metadata={"format": "pt"})
        weight_map.update({k: f.name for k in out})
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = read_hf_config(src)
    cfg["quantization_config"] = dict(QUANTIZATION_CONFIG)
    cfg["torch_dtype"] = cfg["dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def dequantize_dir(fp8_dir: str | Path, dst: str | Path) -> Path:
    """`fp8_dir` dequantised by the definition, with torch: `bf16(fp32(w) * scale_inv)` per
    128 x 128 block, a partial edge block using its own scale (DeepSeek's `weight_dequant`).
    config.json without `quantization_config`, written as `mbr convert` writes it."""
    src, dst = Path(fp8_dir), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if (
            f.is_file()
            and not f.name.endswith(".safetensors")
            and f.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy2(f, dst / f.name)
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        raw = load_file(f)
        out = {}
        for name, t in raw.items():
            if name.endswith("_scale_inv"):
                continue
            s = raw.get(name + "_scale_inv")
            if s is None:
                out[name] = t
                continue
            rows, cols = t.shape
            full = s.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
            out[name] = (t.float() * full).to(torch.bfloat16)
        save_file(out, dst / f.name, metadata={"format": "pt"})
        weight_map.update({k: f.name for k in out})
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = read_hf_config(src)
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def dequantized_reference(fp8_dir: str | Path, dst: str | Path) -> Path:
    """The checkpoint transformers makes of `fp8_dir` (loaded with its FP8 dequantisation,
    saved back): the oracle a converted fp8 checkpoint must equal bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(
        fp8_dir, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(dequantize=True)
    )
    # without the quantiser and the conversions it added, save_pretrained does not quantise again
    for attr in ("hf_quantizer", "_weight_conversions"):
        setattr(model, attr, None)
    model.config.quantization_config = None
    model.save_pretrained(dst)
    for f in Path(fp8_dir).iterdir():  # tokenizer / generation config, as the source has them
        if f.is_file() and not f.name.endswith((".safetensors", ".json")) or f.name == "generation_config.json":
            shutil.copy2(f, Path(dst) / f.name)
    # the config as the source's, less quantization_config (what `mbr convert` writes)
    cfg = read_hf_config(fp8_dir)
    cfg.pop("quantization_config", None)
    (Path(dst) / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return Path(dst)


__all__ = [
    "quantize_fp8",
    "dequantize_dir",
    "quantize_block_fp8",
    "dequantized_reference",
    "is_quantized_name",
    "QUANTIZATION_CONFIG",
]
