"""Under torchrun: train a tiny megatron-core GPTModel (local spec, fp32, CPU init) for a few
steps with megatron DDP + megatron optimizer + `get_forward_backward_func`, and report the
per-step losses and grad norms.

    # reference: one process, tp1·pp1; also writes the initial full weights to INIT
    torchrun --nproc-per-node 1 gpt_parity.py --init INIT --reference
    # layouts, one after another in the same launch; each loads INIT sliced to its shard
    torchrun --nproc-per-node 4 gpt_parity.py --init INIT tp=2,dopt=1 pp=2 tp=2,pp=2,sp=1

    # MoE (tiny_mixtral: 4 experts, top-2, SequentialMLP experts)
    torchrun --nproc-per-node 4 gpt_parity.py --recipe tiny_mixtral --init INIT ep=2 ep=2,tp=2,sp=1

A layout is `key=value` pairs: tp, pp, vpp, sp (sequence parallel), dopt (distributed
optimizer), batched (batch_p2p_comm), ep, etp, ag (allgather instead of alltoall dispatcher). Every layout sees the same global batch each step
(dp ranks take disjoint slices of it), so its losses must equal the reference's.
"""

import argparse
import os
import re

import torch
import torch.nn.functional as F

from megatron_bridge.backends.describe import describe
from megatron_bridge.config.compose import compose
from megatron_bridge.runtime import groups
from megatron_bridge.testing import report

SEQ, GBS, MBS, STEPS, SEED = 32, 8, 2, 6, 1234


def parse_layout(text):
    kv = dict(item.split("=") for item in text.split(",")) if text else {}
    return {k: int(v) for k, v in kv.items()}


def build(cfg, dims, layout):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    tcfg = TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        sequence_parallel=dims.sequence_parallel,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=bool(layout.get("batched", 0)),
        init_method_std=0.02,
        **moe_config(m, dims, layout),
    )
    spec = get_gpt_layer_local_spec(num_experts=m.num_moe_experts, normalization="RMSNorm")
    chunks = []
    for vp in range(dims.vpp or 1):
        vp_stage = vp if dims.vpp else None
        chunks.append(
            GPTModel(
                config=tcfg,
                transformer_layer_spec=spec,
                vocab_size=m.vocab_size,
                max_sequence_length=SEQ,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=True,
                position_embedding_type="rope",
                rotary_base=int(m.rotary_base),
                vp_stage=vp_stage,
            )
        )
    return tcfg, chunks


def moe_config(m, dims, layout):
    if not m.num_moe_experts:
        return {}
    return dict(
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather" if layout.get("ag") else "alltoall",
    )


def global_name(chunk, name):
    """Name of a parameter in the tp1·pp1 model: global layer index; the last stage's copy of
    the tied output weight is the word embedding."""
    if name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        layer = chunk.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"
    match = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", name)
    if match:  # local expert j of ep rank e is global expert e * num_local + j
        from megatron.core import parallel_state as ps

        num_local = chunk.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
        expert = ps.get_expert_model_parallel_rank() * num_local + int(match.group(2))
        name = f"{match.group(1)}{expert}{match.group(3)}"
    return name


def shard(full, param, tp_rank, tp_size):
    """The slice megatron's CPU initialization gives this rank (same split as
    `_initialize_affine_weight_cpu`, honouring the GLU stride)."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, param.partition_stride
    pieces = torch.split(full, param.shape[dim] // stride, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim)


def load_reference(chunks, full_state):
    """Overwrite every parameter with its slice of the reference weights. Returns the max
    |difference| between megatron's own CPU init of this layout and those slices."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    etp = ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    init_diff = 0.0
    with torch.no_grad():
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                rank, size = etp if ".local_experts." in name else tp
                value = shard(full_state[global_name(chunk, name)], param, rank, size)
                assert value.shape == param.shape, (name, value.shape, param.shape)
                init_diff = max(init_diff, (param - value).abs().max().item())
                param.copy_(value)
    return init_diff


def batches(dims, dp_rank, vocab, mbs):
    """This dp rank's micro-batches, per step, of one fixed global batch (the same for every
    layout). Training on the same batch makes the loss fall fast, so every step moves the
    weights a lot and a wrong gradient shows up in the losses, not only in the grad norms."""
    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, vocab, (GBS, SEQ + 1), generator=g)
    per_dp = GBS // dims.dp
    for _ in range(STEPS):
        mine = tokens[dp_rank * per_dp : (dp_rank + 1) * per_dp]
        yield [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in mine.split(mbs)]


def forward_step(data_iterator, model):
    tokens, labels = next(data_iterator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(per_token_loss):
        loss = per_token_loss.float().mean()
        # clone: the schedule divides `loss` in place by the number of micro-batches
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def train(cfg, dims, layout, full_state):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tcfg, chunks = build(cfg, dims, layout)
    if full_state is None:  # the reference: its initial weights are what every layout loads
        init_diff, initial = (
            None,
            {k: v.clone() for k, v in chunks[0].state_dict().items() if isinstance(v, torch.Tensor)},
        )
    else:
        init_diff, initial = load_reference(chunks, full_state), None
    dopt = bool(layout.get("dopt", 0))
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dopt)
    model = [DistributedDataParallel(config=tcfg, ddp_config=ddp_cfg, module=c) for c in chunks]
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.01,
            adam_beta1=0.9,
            adam_beta2=0.95,
            clip_grad=1.0,
            use_distributed_optimizer=dopt,
            params_dtype=torch.float32,
        ),
        model,
    )
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = opt.scale_loss
    tcfg.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    fwd_bwd = get_forward_backward_func()
    losses, norms = [], []
    for micro_batches in batches(dims, ps.get_data_parallel_rank(), cfg.model.vocab_size, dims.micro_batch_size):
        for m in model:
            m.zero_grad_buffer()
        opt.zero_grad()
        data = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
        out = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=data,
            model=model,
            num_microbatches=len(micro_batches),
            seq_length=SEQ,
            micro_batch_size=dims.micro_batch_size,
            forward_only=False,
        )
        ok, grad_norm, _ = opt.step()
        assert ok
        norms.append(float(grad_norm))
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            loss = torch.stack([o["lm loss"] for o in out]).mean()
            torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
            losses.append(loss.item() / ps.get_data_parallel_world_size())
    return initial, losses, norms, init_diff


def dropout_recompute_check(dims):
    """With dropout, full activation recompute must replay the same random masks: the CPU RNG
    tracker and the CPU `_get/_set_cuda_rng_state` restore the generator states. Returns
    (max |grad difference| recompute vs not, max |grad difference| dropout vs no dropout)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    def grads(dropout, recompute):
        groups.initialize(dims, seed=SEED)
        extra = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        tcfg = TransformerConfig(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            ffn_hidden_size=128,
            hidden_dropout=dropout,
            attention_dropout=dropout,
            use_cpu_initialization=True,
            **(extra if recompute else {}),
        )
        model = GPTModel(
            config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=SEQ
        )
        tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(SEED))
        model(tokens, torch.arange(SEQ).expand(2, SEQ), None, labels=tokens).mean().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    with_dropout = grads(0.2, False)
    return ((grads(0.2, True) - with_dropout).abs().max().item(), (grads(0.0, False) - with_dropout).abs().max().item())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", required=True, help="directory of the reference weights")
    parser.add_argument(
        "--reference", action="store_true", help="train the tp1·pp1 reference of each layout's model, save its weights"
    )
    parser.add_argument("layouts", nargs="+")
    args = parser.parse_args()
    results = {}
    for text in args.layouts:
        layout = parse_layout(text)
        recipe = "tiny_mixtral" if layout.get("moe") else "tiny_llama"
        overrides = [
            f"recipe={recipe}",
            f"parallel.tp={layout.get('tp', 1)}",
            f"parallel.ep={layout.get('ep', 1)}",
            f"parallel.etp={layout.get('etp', 'null')}",
            f"parallel.pp={layout.get('pp', 1)}",
            f"parallel.vpp={layout.get('vpp') or 'null'}",
            f"parallel.sequence_parallel={bool(layout.get('sp', 0))}",
            f"train.seq_length={SEQ}",
            f"train.global_batch_size={GBS}",
            f"train.micro_batch_size={layout.get('mbs', MBS)}",
            "model.tie_word_embeddings=true",
        ]
        cfg, _ = compose(overrides)
        dims = groups.dims_from_env(cfg, describe(cfg.model))
        groups.initialize(dims, seed=SEED)
        init_path = os.path.join(args.init, f"{recipe}.pt")
        full_state = None if args.reference else torch.load(init_path)
        initial, losses, norms, init_diff = train(cfg, dims, layout, full_state)
        if args.reference:
            torch.save(initial, init_path)
        mpu = groups.MegatronMPU()
        results[text] = {
            "losses": losses,
            "grad_norms": norms,
            "init_diff": init_diff,
            "tp_rank": mpu.get_tensor_model_parallel_rank(),
            "pp_rank": mpu.get_pipeline_model_parallel_rank(),
        }
    if args.reference:
        recompute_diff, dropout_effect = dropout_recompute_check(dims)
        report({"recompute_grad_diff": recompute_diff, "dropout_grad_effect": dropout_effect})
    report({"rank": torch.distributed.get_rank(), "layouts": results})
    groups.destroy()


if __name__ == "__main__":
    main()
