"""GPT-OSS: MoE with learned attention sinks, biases everywhere, clamped SwiGLU experts.

The building blocks are features (sinks.py, bias.py, glu.py; sliding windows on alternating
layers via `layer_types` in attention.py); this file only declares them and maps names.
The experts are stored as stacked 3-D tensors ([E, hidden, 2·inter] with gate/up
interleaved on the last dim, [E, inter, hidden]: transposed relative to nn.Linear), which
`mapping.ExpertsStacked` turns into megatron's per-expert linears. Routing is top-k on the
router logits then a softmax over the k (megatron's pre_softmax=False). Real GPT-OSS
checkpoints store experts as MXFP4 blocks/scales; only dequantised (bf16/fp32) checkpoints,
as save_pretrained writes them, are read.
"""

from megatron_bridge.bridge.families.common import ATTENTION, EMBEDDINGS, H, L
from megatron_bridge.bridge.mapping import COLUMN, GATE_UP, REPLICATED, ROW, ExpertsStacked
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.table import Mapping

_E = f"{L}.mlp.experts.local_experts.{{expert}}"
_HE = f"{H}.mlp.experts"


@register
class GptOss(FamilyBridge):
    name = "gpt_oss"
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
