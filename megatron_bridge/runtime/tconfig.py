"""`BridgeSpec` + layout -> megatron-core `TransformerConfig` and the GPTModel arguments.

The architecture comes from the spec, every degree and the stage split from the layout,
nothing from anywhere else; each building block adds its settings (its `config` hook,
runtime/blocks/).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.runtime.blocks.base import blocks
from megatron_bridge.runtime.blocks.mla import mla_config_class


def gelu_tanh(x):
    """GeGLU's gate activation: transformers' `gelu_pytorch_tanh` (a module-level function so
    the TransformerConfig stays picklable)."""
    return F.gelu(x, approximate="tanh")


def activation_func(spec: BridgeSpec):
    """The MLP activation: `spec.activation` on the GLU gate; the non-gated GPT MLP is GELU."""
    if not spec.gated_linear_unit:
        return F.gelu
    return {"silu": F.silu, "gelu_tanh": gelu_tanh, "gelu": F.gelu}[spec.activation]


def transformer_config(spec: BridgeSpec, layout: Any, **overrides: Any):
    """megatron-core TransformerConfig for `spec` under `layout` (a `Layout`)."""
    kw = transformer_config_kwargs(spec, layout, **overrides)
    return mla_config_class(kw)(**kw)


def transformer_config_kwargs(spec: BridgeSpec, layout: Any, **overrides: Any) -> dict[str, Any]:
    """The TransformerConfig arguments: the architecture from `spec`, every degree and the
    stage split from `layout`, nothing from anywhere else.

    CPU-friendly defaults (no fused kernels, cpu initialisation when there is no GPU);
    `overrides` win (params_dtype, bf16, recompute, ...).
    """
    on_gpu = torch.cuda.is_available()
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization=spec.normalization,
        layernorm_epsilon=spec.norm_epsilon,
        gated_linear_unit=spec.gated_linear_unit,
        activation_func=activation_func(spec),
        add_bias_linear=spec.add_bias_linear,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=spec.attention_dropout,
        init_method_std=spec.initializer_range,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.pp > 1 else None,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sequence_parallel and layout.tp > 1,
        num_layers_in_first_pipeline_stage=layout.layers_first_stage,
        num_layers_in_last_pipeline_stage=layout.layers_last_stage,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # gloo: batched p2p gives wrong results with interleaved schedules (notes).
        batch_p2p_comm=on_gpu,
    )
    if spec.is_moe:
        kw.update(
            num_moe_experts=spec.num_moe_experts,
            moe_router_topk=spec.moe_router_topk,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=spec.moe_shared_expert_gate,
            moe_router_pre_softmax=spec.moe_router_pre_softmax,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            moe_layer_freq=list(spec.moe_layer_pattern) if spec.moe_layer_pattern else 1,
        )
    for block in blocks():
        block.config(spec, kw)
    kw.update(overrides)
    if kw.get("bias_activation_fusion") and not fusable_activation(kw):
        kw["bias_activation_fusion"] = False  # train.fused: megatron fuses only these activations
    if kw.get("bf16") and "params_dtype" not in overrides:
        kw["params_dtype"] = torch.bfloat16
    if "pipeline_dtype" not in kw:
        kw["pipeline_dtype"] = kw.get("params_dtype", torch.float32)
    return kw


def fusable_activation(kw: dict[str, Any]) -> bool:
    """Whether megatron-core's fused bias+activation (`bias_activation_fusion`) computes this MLP's
    activation exactly: SwiGLU without a GLU clamp or offset (which its kernel does not apply).
    Its GeLU kernels are the tanh approximation, not the exact GeLU they would replace."""
    if kw.get("activation_func_clamp_value") is not None or kw.get("glu_linear_offset", 0.0):
        return False
    return kw.get("activation_func") is F.silu and bool(kw.get("gated_linear_unit"))


def gpt_model_kwargs(spec: BridgeSpec, layout: Any) -> dict[str, Any]:
    """GPTModel constructor arguments besides config/spec/pre/post_process/vp_stage."""
    return dict(
        vocab_size=spec.padded_vocab_size(layout.tp),
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type=spec.position_embedding_type,
        rotary_base=spec.rotary_base,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        parallel_output=True,
    )
