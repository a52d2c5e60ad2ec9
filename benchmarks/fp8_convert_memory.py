"""Peak memory and speed of `mbr convert` from an FP8 block-quantised DeepSeek-V3 checkpoint.

    .venv/bin/python benchmarks/fp8_convert_memory.py [WORKDIR] [LAYERS] [EXPERTS] [--reps 3] [--workers 1,0]

Writes (without torch) a deepseek_v3 checkpoint with DeepSeek-V3's names and shapes — hidden
7168; MLA: q_a 1536 x 7168, q_b 24576 x 1536, kv_a_proj_with_mqa 576 x 7168 (a partial
block row), kv_b 32768 x 512, o_proj 7168 x 16384 (128 heads); a dense first layer (MLP
18432); MoE layers of EXPERTS routed experts (2048 x 7168) + one shared expert, router and
fp32 e_score_correction_bias; one multi-token-prediction layer (model.layers.LAYERS: a MoE
decoder layer + enorm/hnorm, eh_proj, embed_tokens, shared_head) — stored as the hub stores
DeepSeek-V3: every decoder linear `float8_e4m3fn` with an fp32 `weight_scale_inv` per 128 x
128 block; embeddings, lm_head, norms, routers, eh_proj and shared_head.head bf16; the bias
fp32; `quantization_config` in config.json. The defaults (2 layers, 4 experts) convert
~1.1 GB of weights (~1.0 G fp8). Then converts it (torch_dist, and per-rank files at tp2) as
a child process, for each `workers=` count, each run right after a `cp -r` of the source
(both with the input evicted from the page cache and timed until the output is on disk), and
prints the ratio to cp, the fp8 weights per second, and the child's peak RSS against the
bound the converter promises, workers x 2 x the largest (bf16) tensor + 1 GiB. The numbers
in docs/benchmarks.md come from this command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time
from array import array
from math import ceil
from pathlib import Path

from disk import cp_seconds, evict, settle

from megatron_bridge.convert.bytemove.pool import resolve_workers

HIDDEN, DENSE_FFN, MOE_FFN, HEADS, VOCAB = 7168, 18432, 2048, 128, 4096
Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 1536, 512, 128, 64, 128
BLOCK = 128


def fp8_bytes(n: int) -> bytes:
    """Random e4m3fn bytes without the two NaN codes."""
    return os.urandom(n).translate(bytes(b - 1 if b in (0x7F, 0xFF) else b for b in range(256)))


def bf16_bytes(n: int) -> bytes:
    """n random bf16 values of magnitude ~0.01 (exponent byte fixed, mantissa random)."""
    buf = bytearray(os.urandom(2 * n))
    buf[1::2] = bytes([0x3C]) * n
    return bytes(buf)


def layer(p: str, moe: bool, experts: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """One decoder layer's tensors (fp8 linears are followed by their scale grids)."""
    out = [
        (p + n + ".weight", "BF16", (d,))
        for n, d in (("input_layernorm", HIDDEN), ("post_attention_layernorm", HIDDEN))
    ]
    out += [
        (p + "self_attn.q_a_layernorm.weight", "BF16", (Q_LORA,)),
        (p + "self_attn.kv_a_layernorm.weight", "BF16", (KV_LORA,)),
    ]
    lin = {
        "self_attn.q_a_proj": (Q_LORA, HIDDEN),
        "self_attn.q_b_proj": (HEADS * (NOPE + ROPE), Q_LORA),
        "self_attn.kv_a_proj_with_mqa": (KV_LORA + ROPE, HIDDEN),
        "self_attn.kv_b_proj": (HEADS * (NOPE + V_DIM), KV_LORA),
        "self_attn.o_proj": (HIDDEN, HEADS * V_DIM),
    }
    mlps = [f"mlp.experts.{e}" for e in range(experts)] + ["mlp.shared_experts"] if moe else ["mlp"]
    for m in mlps:
        ffn = MOE_FFN if moe else DENSE_FFN
        lin.update({f"{m}.gate_proj": (ffn, HIDDEN), f"{m}.up_proj": (ffn, HIDDEN), f"{m}.down_proj": (HIDDEN, ffn)})
    for name, shape in lin.items():
        out.append((p + name + ".weight", "F8_E4M3", shape))
        out.append((p + name + ".weight_scale_inv", "F32", tuple(ceil(n / BLOCK) for n in shape)))
    if moe:
        out += [
            (p + "mlp.gate.weight", "BF16", (experts, HIDDEN)),
            (p + "mlp.gate.e_score_correction_bias", "F32", (experts,)),
        ]
    return out


def tensors(layers: int, experts: int) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", "BF16", (VOCAB, HIDDEN))]
    for i in range(layers):
        out += layer(f"model.layers.{i}.", i >= 1, experts)
    out += [("model.norm.weight", "BF16", (HIDDEN,)), ("lm_head.weight", "BF16", (VOCAB, HIDDEN))]
    mtp = f"model.layers.{layers}."
    out += layer(mtp, True, experts) + [
        (mtp + "enorm.weight", "BF16", (HIDDEN,)),
        (mtp + "hnorm.weight", "BF16", (HIDDEN,)),
        (mtp + "eh_proj.weight", "BF16", (HIDDEN, 2 * HIDDEN)),
        (mtp + "embed_tokens.weight", "BF16", (VOCAB, HIDDEN)),
        (mtp + "shared_head.norm.weight", "BF16", (HIDDEN,)),
        (mtp + "shared_head.head.weight", "BF16", (VOCAB, HIDDEN)),
    ]
    return out


def nbytes(dt: str, shape: tuple[int, ...]) -> int:
    n = {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dt]
    for d in shape:
        n *= d
    return n


def config(layers: int, experts: int) -> dict[str, object]:
    """DeepSeek-V3's config.json, scaled to `layers` and `experts`."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": HIDDEN,
        "intermediate_size": DENSE_FFN,
        "moe_intermediate_size": MOE_FFN,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": V_DIM,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "vocab_size": VOCAB,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }


def write_checkpoint(root: Path, layers: int, experts: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    entries = tensors(layers, experts)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, dt, shape in entries:
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [pos, pos + nbytes(dt, shape)]}
        pos += nbytes(dt, shape)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, dt, shape in entries:
            count = nbytes(dt, shape) // {"BF16": 2, "F32": 4, "F8_E4M3": 1}[dt]
            if dt == "F8_E4M3":
                f.write(fp8_bytes(count))
            elif dt == "F32":  # scales (amax / 448 of weights of magnitude ~0.01-0.1) and the bias
                f.write(array("f", [(1 + (i % 7)) * 2e-5 for i in range(count)]).tobytes())
            else:
                f.write(bf16_bytes(count))
    (root / "config.json").write_text(json.dumps(config(layers, experts), indent=2))


def convert(src: Path, dst: Path, args: list[str]) -> tuple[float, float, float, dict[str, int]]:
    """(seconds until the output is on disk, CPU seconds, peak RSS in GiB, the manifest's file
    CRC-32s) of `mbr convert` in a fresh child process whose input was evicted from the page
    cache first."""
    shutil.rmtree(dst, ignore_errors=True)
    evict(src)
    settle()
    code = "import sys; from megatron_bridge.cli import main; sys.exit(main(sys.argv[1:]))"
    t = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-c", code, "convert", f"src={src}", f"dst={dst}", "progress=off", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS and CPU time
    child.returncode = os.waitstatus_to_exitcode(status)
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - t
    if child.returncode != 0:
        raise SystemExit(f"mbr convert {' '.join(args)} failed ({child.returncode})")
    crcs = json.loads((dst / "mbr_manifest.json").read_text())["file_crc32"]
    # DCP's index holds a fresh save_id (a uuid) per save, as torch's own writer does; its entries are compared
    # in tests/unit/convert/test_convert_direct.py. Every other file must be the same bytes on every run.
    crcs = {name: crc for name, crc in crcs.items() if not name.endswith(".metadata")}
    shutil.rmtree(dst, ignore_errors=True)
    return seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 2**20, crcs  # ru_maxrss is in KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workdir", nargs="?", default="/tmp/mbr-fp8-bench")
    ap.add_argument("layers", nargs="?", type=int, default=2)
    ap.add_argument("experts", nargs="?", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3, help="runs of each conversion, each after its own cp -r")
    ap.add_argument("--workers", default="1,0", help="workers= counts to run (0: one per core)")
    a = ap.parse_args()
    work, layers, experts = Path(a.workdir), a.layers, a.experts
    src = work / f"fp8-ds3-{layers}l{experts}e"
    if not (src / "model.safetensors").is_file():
        write_checkpoint(src, layers, experts)
    entries = tensors(layers, experts)
    mtp = f"model.layers.{layers}."
    converted = [(n, dt, s) for n, dt, s in entries if not n.startswith(mtp)]
    read = sum(nbytes(dt, s) for _, dt, s in converted)
    weights = sum(nbytes(dt, s) for _, dt, s in converted if dt == "F8_E4M3")
    largest = max(2 * nbytes("F8_E4M3", s) if dt == "F8_E4M3" else nbytes(dt, s) for _, dt, s in converted)
    print(
        f"source: {(src / 'model.safetensors').stat().st_size / 1e9:.3f} GB deepseek_v3 fp8 checkpoint, {layers} layers "
        f"(1 dense) + 1 MTP layer, {experts} routed experts + 1 shared; converted: {read / 1e9:.3f} GB "
        f"({weights / 1e9:.3f} G fp8 weights; the MTP layer is skipped); largest tensor {largest / 1e9:.3f} GB as bf16; "
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; inputs evicted from the page cache, "
        "times until the output is on disk (sync)"
    )
    print(
        "| output | workers | best s (median) | cp -r just before, best s | vs cp (best/best) | fp8 weights/s | "
        "CPU s | peak RSS GiB | bound GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    same = []  # per output: whether every run (each workers= count, each repetition) wrote the same files
    for args in (["format=torch_dist"], ["format=torch", "parallel.tp=2"]):
        files = []
        for w in a.workers.split(","):
            n = resolve_workers(int(w))
            runs = []
            for _ in range(a.reps):
                cp = cp_seconds(src, work / "cp")
                runs.append((cp, *convert(src, work / "out", [*args, f"workers={w}"])))
                files.append(runs[-1][4])
            best_cp, best = min(r[0] for r in runs), min(r[1] for r in runs)
            peak = max(r[3] for r in runs)
            bound = n * 2 * largest / 2**30 + 1.0  # every worker holds one row's bf16 (2 x largest at most)
            print(
                f"| {' '.join(args)} | {n} | {best:.2f} ({statistics.median(r[1] for r in runs):.2f}) | {best_cp:.2f} | "
                f"{best_cp / best:.2f}x | {weights / best / 1e6:.0f} M | {min(r[2] for r in runs):.1f} | {peak:.2f} | "
                f"{bound:.2f} {'OK' if peak <= bound else 'OVER'} |",
                flush=True,
            )
        same.append(f"{' '.join(args)}: {'identical files' if all(f == files[0] for f in files) else 'FILES DIFFER'}")
    print(f"outputs of every run and workers= count (manifest file CRC-32s, DCP's .metadata aside): {'; '.join(same)}")


if __name__ == "__main__":
    main()
