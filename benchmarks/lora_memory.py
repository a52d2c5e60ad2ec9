"""Gradient and optimizer-state memory of LoRA vs full fine-tuning, measured on the real
objects: megatron-core DDP's gradient buffers and the megatron optimizer's states (Adam m, v
and, in bf16, the fp32 main parameters), after one training step of the same model.

    torchrun --nproc-per-node 1 benchmarks/lora_memory.py [HIDDEN LAYERS RANK]

Prints one JSON line per mode and the LoRA/full ratios. The numbers in docs/benchmarks.md
come from this command (fp32 on CPU; bf16 adds 4 bytes of main parameter per trained one).
"""

import json
import sys

import torch


def measure(hidden: int, layers: int, rank: int, lora: bool) -> dict:
    from megatron.core.optimizer import ChainedOptimizer, OptimizerConfig, get_megatron_optimizer

    from megatron_bridge.backends.describe import describe
    from megatron_bridge.bridge.layout import Layout
    from megatron_bridge.config.compose import compose
    from megatron_bridge.config.schema import PeftConfig
    from megatron_bridge.runtime.build import build_model
    from megatron_bridge.runtime.lora_modules import apply_lora
    from megatron_bridge.runtime.parity import ensure_groups, make_batch
    from megatron_bridge.runtime.schedule import forward_backward, wrap_ddp

    cfg, _ = compose(
        [
            "recipe=tiny_llama",
            f"model.hidden_size={hidden}",
            f"model.ffn_hidden_size={hidden * 8 // 3 // 64 * 64}",
            "model.num_attention_heads=8",
            "model.num_query_groups=4",
            f"model.num_layers={layers}",
            "model.vocab_size=8000",
            "model.make_vocab_size_divisible_by=128",
        ]
    )
    ensure_groups(Layout(), 1)
    spec = describe(cfg.model)
    chunks = build_model(spec, Layout())
    if lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        apply_lora(chunks, spec, PeftConfig(method="lora", rank=rank, alpha=2.0 * rank, target_modules=targets))
    ddp = wrap_ddp(chunks)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, bf16=False), ddp)
    ids, labels = make_batch(8000, batch=2, seq=64)
    forward_backward(ddp, ids, labels)
    opt.step()

    def nbytes(t):
        return t.numel() * t.element_size()

    grads = sum(nbytes(b.grad_data) for d in ddp for b in [*d.buffers, *d.expert_parallel_buffers])
    opts = opt.chained_optimizers if isinstance(opt, ChainedOptimizer) else [opt]
    states = sum(nbytes(v) for o in opts for st in o.optimizer.state.values() for v in st.values() if v.dim())
    params = sum(p.numel() for c in chunks for p in c.parameters())
    trained = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
    return {
        "mode": "lora" if lora else "full",
        "params": params,
        "trained": trained,
        "grad_bytes": grads,
        "optimizer_bytes": states,
    }


def main() -> None:
    hidden, layers, rank = (int(x) for x in (sys.argv[1:4] or (512, 4, 8)))
    full = measure(hidden, layers, rank, lora=False)
    lora = measure(hidden, layers, rank, lora=True)
    for row in (full, lora):
        print(json.dumps({**row, "hidden": hidden, "layers": layers, "rank": rank}))
    ratio = (lora["grad_bytes"] + lora["optimizer_bytes"]) / (full["grad_bytes"] + full["optimizer_bytes"])
    print(json.dumps({"lora_over_full_grad_plus_optimizer": round(ratio, 5)}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
