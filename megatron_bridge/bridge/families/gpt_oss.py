"""GPT-OSS: MoE with learned attention sinks, biases everywhere, clamped SwiGLU experts.

The building blocks are features (sinks.py, bias.py, glu.py; sliding windows on alternating
layers via `layer_types` in attention.py); this file only declares them and maps names.
The experts are stored as stacked 3-D tensors ([E, hidden, 2·inter] with gate/up
interleaved on the last dim, [E, inter, hidden]: transposed relative to nn.Linear), which
`stacked.ExpertsStacked` turns into megatron's per-expert linears. Routing is top-k on the
router logits then a softmax over the k (megatron's pre_softmax=False). Real GPT-OSS
checkpoints store experts as MXFP4 blocks/scales; only dequantised (bf16/fp32) checkpoints,
as save_pretrained writes them, are read.
"""

from megatron_bridge.bridge.families.common import ATTENTION, EMBEDDINGS, H, L
from megatron_bridge.bridge.mapping import COLUMN, GATE_UP, REPLICATED, ROW
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.stacked import ExpertsStacked
from megatron_bridge.bridge.table import Mapping

_E = f"{L}.mlp.experts.local_experts.{{expert}}"
_HE = f"{H}.mlp.experts"


@register
class GptOss(FamilyBridge):
    name = "gpt_oss"
    tiny = (  # every GPT-OSS feature
        "GptOssConfig",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters=dict(  # yarn with its attention factor; 16 < the 32-token test batch
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=16,
                beta_fast=32.0,
                beta_slow=1.0,
            ),
            swiglu_limit=0.2,  # small: the random tiny activations must reach the clamp
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("gpt_oss",)
    architectures = ("GptOssForCausalLM",)
    implicit = {"attention_sinks": True, "mlp_bias": True, "moe_router_bias": True, "glu_linear_offset": 1.0}
    hf_names = {"num_moe_experts": "num_local_experts", "moe_ffn_hidden_size": "intermediate_size"}
    window_key = "layer_types"
    table = (
        EMBEDDINGS
        + ATTENTION
        + (
            Mapping(f"{L}.self_attention.linear_proj.bias", f"{H}.self_attn.o_proj.bias", REPLICATED),
            Mapping(f"{L}.self_attention.core_attention.softmax_offset", f"{H}.self_attn.sinks", COLUMN),
            Mapping(f"{L}.mlp.router.weight", f"{H}.mlp.router.weight", REPLICATED),
            Mapping(f"{L}.mlp.router.bias", f"{H}.mlp.router.bias", REPLICATED),
            Mapping(f"{_E}.linear_fc1.weight", f"{_HE}.gate_up_proj", ExpertsStacked(GATE_UP, "gate_up")),
            Mapping(f"{_E}.linear_fc1.bias", f"{_HE}.gate_up_proj_bias", ExpertsStacked(GATE_UP, "gate_up")),
            Mapping(f"{_E}.linear_fc2.weight", f"{_HE}.down_proj", ExpertsStacked(ROW, "linear")),
            Mapping(f"{_E}.linear_fc2.bias", f"{_HE}.down_proj_bias", ExpertsStacked(REPLICATED, "same")),
        )
    )
    notes = "MoE (top-k then softmax) with biases, learned attention sinks, clamped SwiGLU, alternating windows"
