"""`gpt`: megatron-core's GPT as GPT-2/3 and the 1T GPT define it, with no HF weight table.

LayerNorm, GELU MLP, biases on every linear layer and learned absolute positions are
model fields (`model.normalization`, ...) the builder passes to megatron-core; the family
fixes none of them. It trains from scratch: there is no HF class whose weights it maps.
"""

from megatron_bridge.bridge.registry import FamilyBridge, register


@register
class GPT(FamilyBridge):
    name = "gpt"
    fixed = {}
    hf_weights = False
    notes = "megatron GPT (LayerNorm/GELU/biases/learned positions as configured); no HF weights"
