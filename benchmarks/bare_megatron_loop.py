"""The baseline for train_overhead.py: a bare megatron-core training loop, no Hydra, no
megatron_bridge wrappers except the CPU shim (megatron-core cannot run on CPU without it;
on a GPU the shim is a no-op). Same model shape, layout, optimizer and synthetic data as
the `python -m megatron_bridge.train` run it is compared with. Prints one JSON line per step.

    torchrun --nproc-per-node 2 benchmarks/bare_megatron_loop.py --tp 2 --steps 30 --hidden 256 --layers 4
        --seq 256 --gbs 8 [--heads 8] [--kv 4] [--ffn 1024] [--vocab 512] [--recompute none|full] [--compile] [--fused] [--fp8 tensorwise|rowwise]
        [--head-dim 128] [--experts 128 --topk 8 --moe-ffn 768]

`--compile`: every decoder layer through `torch.compile` as `train.compile=true` does it
(runtime/compiled.py), so the compiled run is compared with the same kernels. `--recompute full`:
megatron's uniform full recompute, one layer at a time (as `train.recompute=full`). `--fp8`: the
layers' linears through the float8 GEMMs of `train.precision=fp8` (runtime/fp8.py).
"""

import argparse
import json
import time
from datetime import timedelta

import torch
import torch.nn.functional as F


def args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    for name, default in (("tp", 1), ("steps", 30), ("hidden", 256), ("layers", 4), ("seq", 256), ("gbs", 8)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv", type=int, default=0, help="KV groups (0: heads / 2)")
    ap.add_argument("--ffn", type=int, default=0, help="FFN hidden size (0: 4 x hidden)")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--recompute", default="none", choices=("none", "full"))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--fp8", default="", choices=("", "tensorwise", "rowwise"), help="float8 GEMMs (torchao)")
    ap.add_argument("--fused", action="store_true", help="megatron-core's fused kernels (as train.fused=true)")
    ap.add_argument("--head-dim", type=int, default=0, help="attention head dim (0: hidden / heads)")
    ap.add_argument("--experts", type=int, default=0, help="MoE experts per layer (0: dense)")
    ap.add_argument("--topk", type=int, default=2, help="MoE experts per token")
    ap.add_argument("--moe-ffn", type=int, default=0, help="an expert's FFN hidden size (0: --ffn)")
    return ap.parse_args()


def main():
    a = args()
    tp, steps, hidden, layers, seq, gbs, heads, compiled = (
        a.tp,
        a.steps,
        a.hidden,
        a.layers,
        a.seq,
        a.gbs,
        a.heads,
        a.compile,
    )
    recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    moe = dict(  # what runtime/tconfig.py sets for an MoE model
        num_moe_experts=a.experts,
        moe_router_topk=a.topk,
        moe_ffn_hidden_size=a.moe_ffn or a.ffn or 4 * a.hidden,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
    )
    torch.distributed.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=10))
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_bridge.runtime import cpu, megatron_fixes

    cuda = torch.cuda.is_available()
    if not cuda:
        cpu.install()
    megatron_fixes.apply()  # an MoE router without Transformer Engine (megatron-core 0.16.1's NameError)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    cpu.model_parallel_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=a.ffn or 4 * hidden,
        num_attention_heads=heads,
        num_query_groups=a.kv or heads // 2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=not cuda,
        bias_activation_fusion=a.fused,  # SwiGLU (train.fused=true; runtime/tconfig.py fusable_activation)
        bias_dropout_fusion=a.fused,
        cross_entropy_loss_fusion=a.fused and cuda,  # bf16 runs only (train/job.py model_overrides)
        cross_entropy_fusion_impl="native",
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        bf16=cuda,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        pipeline_dtype=torch.bfloat16 if cuda else torch.float32,
        kv_channels=a.head_dim or None,
        **(recompute if a.recompute == "full" else {}),
        **(moe if a.experts else {}),
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=a.experts or None, moe_grouped_gemm=False),
        vocab_size=a.vocab,
        max_sequence_length=seq,
        position_embedding_type="rope",
        pre_process=True,
        post_process=True,
    )
    if cuda:
        model.cuda()
    if a.fp8:  # the same float8 GEMMs as train.precision=fp8 (runtime/fp8.py)
        from megatron_bridge.runtime.fp8 import use_fp8

        use_fp8([model], lambda m: m.decoder.layers, a.fp8)
    if compiled:
        from megatron_bridge.runtime.compiled import compile_layers

        compile_layers([model], lambda m: m.decoder.layers)
    ddp = DistributedDataParallel(
        config=cfg, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    cfg.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, clip_grad=1.0, bf16=cuda, params_dtype=cfg.params_dtype), [ddp]
    )
    dev = torch.device("cuda") if cuda else torch.device("cpu")
    g = torch.Generator().manual_seed(0)

    def batches():
        while True:
            t = torch.randint(0, a.vocab, (1, seq + 1), generator=g)
            yield {
                "tokens": t[:, :-1].to(dev),
                "labels": t[:, 1:].to(dev),
                "position_ids": torch.arange(seq, device=dev).unsqueeze(0),
            }

    def step_fn(it, m):
        b = next(it)
        out = m(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    data = batches()
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        get_forward_backward_func()(
            forward_step_func=step_fn,
            data_iterator=data,
            model=ddp,
            num_microbatches=gbs,
            seq_length=seq,
            micro_batch_size=1,
            forward_only=False,
        )
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if torch.distributed.get_rank() == 0:
            print(json.dumps({"step": step, "step_time": time.perf_counter() - t0, "time": time.time()}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
