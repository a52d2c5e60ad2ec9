"""Peak memory and speed of `mbr convert` from an FP8 block-quantised checkpoint.

    .venv/bin/python benchmarks/fp8_convert_memory.py [WORKDIR] [LAYERS]

Writes (without torch) a Llama-named checkpoint with DeepSeek-V3's linear shapes — hidden
7168, dense MLP 18432, 56 heads of 128, 8 KV heads — stored the way the hub stores
DeepSeek-V3: every linear weight `float8_e4m3fn` with an fp32 `weight_scale_inv` per 128 x 128
block, embedding / output layer / norms bf16, `quantization_config` in config.json. Two
layers are ~1.1 GB. Then converts it (torch_dist, and per-rank files at tp2) as a child
process and prints the child's peak RSS against the bound the converter promises for a
tensor-path conversion, 2 x the largest (bf16) tensor + 1 GiB, and the throughput in fp8
source bytes. The numbers in docs/benchmarks.md come from this command.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from array import array
from math import ceil
from pathlib import Path

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 7168, 18432, 56, 8, 128, 4096
BLOCK = 128


def fp8_bytes(n: int) -> bytes:
    """Random e4m3fn bytes without the two NaN codes."""
    return os.urandom(n).translate(bytes(b - 1 if b in (0x7F, 0xFF) else b for b in range(256)))


def bf16_bytes(n: int) -> bytes:
    """n random bf16 values of magnitude ~0.01 (exponent byte fixed, mantissa random)."""
    buf = bytearray(os.urandom(2 * n))
    buf[1::2] = bytes([0x3C]) * n
    return bytes(buf)


def tensors(layers: int) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))]
    lin = {
        "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
        "mlp.gate_proj": (FFN, HIDDEN),
        "mlp.up_proj": (FFN, HIDDEN),
        "mlp.down_proj": (HIDDEN, FFN),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", "BF16", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", "BF16", (HIDDEN,)),
        ]
        for name, shape in lin.items():
            out.append((p + name + ".weight", "F8_E4M3", shape))
            out.append((p + name + ".weight_scale_inv", "F32", tuple(ceil(n / BLOCK) for n in shape)))
    out += [("model.norm.weight", "BF16", (HIDDEN,)), ("lm_head.weight", "BF16", (VOCAB, HIDDEN))]
    return out


def write_checkpoint(root: Path, layers: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    entries = tensors(layers)
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dt, shape in entries:
        n = size[dt]
        for d in shape:
            n *= d
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, dt, shape in entries:
            count = 1
            for d in shape:
                count *= d
            if dt == "F8_E4M3":
                f.write(fp8_bytes(count))
            elif dt == "F32":  # scales: amax / 448 of weights of magnitude ~0.01-0.1
                f.write(array("f", [(1 + (i % 7)) * 2e-5 for i in range(count)]).tobytes())
            else:
                f.write(bf16_bytes(count))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }
    (root / "config.json").write_text(json.dumps(cfg, indent=2))


def convert(src: Path, dst: Path, args: list[str]) -> tuple[float, float]:
    """(seconds, peak RSS in GiB) of `mbr convert` in a fresh child process."""
    shutil.rmtree(dst, ignore_errors=True)
    code = "import sys; from megatron_bridge.cli import main; sys.exit(main(sys.argv[1:]))"
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, "convert", f"src={src}", f"dst={dst}", "progress=off", *args])
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS
    child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t
    if child.returncode != 0:
        raise SystemExit(f"mbr convert {' '.join(args)} failed ({child.returncode})")
    peak = usage.ru_maxrss
    shutil.rmtree(dst, ignore_errors=True)
    return seconds, peak / 2**20  # ru_maxrss is in KiB on Linux


def main() -> None:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mbr-fp8-bench")
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    src = work / "fp8"
    if not (src / "model.safetensors").is_file():
        write_checkpoint(src, layers)
    fp8_bytes_total = (src / "model.safetensors").stat().st_size
    largest = max(2 * max(s[0] * (s[1] if len(s) > 1 else 1) for _, _, s in tensors(layers)), 0)
    bound = 2 * largest / 2**30 + 1.0
    print(
        f"source: {fp8_bytes_total / 1e9:.3f} GB fp8 checkpoint, {layers} layers; largest tensor {largest / 1e9:.3f} GB as bf16"
    )
    for args in (["format=torch_dist"], ["format=torch", "parallel.tp=2"]):
        seconds, peak = convert(src, work / "out", args)
        print(
            f"{' '.join(args):28s} {seconds:6.1f} s  {fp8_bytes_total / seconds / 1e9:.3f} GB/s (fp8 in)  "
            f"peak RSS {peak:.2f} GiB  bound 2 x largest + 1 GiB = {bound:.2f} GiB  "
            f"{'OK' if peak <= bound else 'OVER'}"
        )


if __name__ == "__main__":
    main()
