"""OLMo-2 (norms on the sublayer outputs, full qk-norm) and OLMoE (full qk-norm, MoE, clip_qkv).

Both normalise the whole q and k projections (`qk_norm_type="full"`): the norm weights have
one entry per (head, dim), whole on every TP rank (features/qk_norm.py says why). OLMo-2 has no input or
pre-MLP norm: its `post_attention_layernorm` / `post_feedforward_layernorm` normalise the
attention / MLP outputs before the residual add (features/sublayer.py).
"""

from megatron_bridge.bridge.families.common import ATTENTION, DENSE_MLP, EMBEDDINGS, H, L, experts
from megatron_bridge.bridge.mapping import REPLICATED
from megatron_bridge.bridge.registry import FamilyBridge, register
from megatron_bridge.bridge.table import Mapping

FULL_QK_NORM: tuple[Mapping, ...] = (
    Mapping(f"{L}.self_attention.q_layernorm.weight", f"{H}.self_attn.q_norm.weight", REPLICATED),
    Mapping(f"{L}.self_attention.k_layernorm.weight", f"{H}.self_attn.k_norm.weight", REPLICATED),
)

# q/k/v and o_proj only: OLMo-2 has no input / pre-MLP norm
PROJECTIONS = tuple(m for m in ATTENTION if "layernorm" not in m.megatron)

POST_NORMS: tuple[Mapping, ...] = (
    Mapping(f"{L}.self_attention.post_layernorm.weight", f"{H}.post_attention_layernorm.weight", REPLICATED),
    Mapping(f"{L}.mlp.post_layernorm.weight", f"{H}.post_feedforward_layernorm.weight", REPLICATED),
)


@register
class Olmo2(FamilyBridge):
    name = "olmo2"
    tiny = ("Olmo2Config", dict(eos_token_id=None))  # bridge/tiny.py: every feature of the family on
    model_types = ("olmo2",)
    architectures = ("Olmo2ForCausalLM",)
    implicit = {
        "qk_layernorm": True,
        "qk_norm_type": "full",
        "pre_norms": False,
        "post_attention_norm": True,
        "post_mlp_norm": True,
    }
    table = EMBEDDINGS + PROJECTIONS + FULL_QK_NORM + POST_NORMS + DENSE_MLP
    notes = "norms on the sublayer outputs (no pre-norms), qk-norm over the whole projection"


@register
class Olmoe(FamilyBridge):
    name = "olmoe"
    tiny = (
        "OlmoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            norm_topk_prob=False,
            clip_qkv=1.0,
            eos_token_id=None,
        ),
    )  # bridge/tiny.py: every feature of the family on
    model_types = ("olmoe",)
    architectures = ("OlmoeForCausalLM",)
    implicit = {"qk_layernorm": True, "qk_norm_type": "full"}
    hf_names = {"num_moe_experts": "num_experts", "moe_ffn_hidden_size": "intermediate_size"}
    table = (
        EMBEDDINGS
        + ATTENTION
        + FULL_QK_NORM
        + experts("mlp.experts", "gate_proj", "up_proj", "down_proj", "mlp.gate.weight")
    )
    notes = "MoE (softmax top-k), qk-norm over the whole projection, clip_qkv"
