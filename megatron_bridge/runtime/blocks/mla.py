"""Multi-head Latent Attention's build hooks (DeepSeek-V2/V3, Kimi-K2, Moonlight; the
description: bridge/features/mla.py): megatron-core's own `MLASelfAttention` from the local
spec, which computes what transformers' DeepseekV2/V3 attention computes:

* projections: q = q_b_proj(RMSNorm(q_a_proj(x))) (or q_proj(x) without `q_lora_rank`,
  DeepSeek-V2-Lite); [c_kv, k_rope] = kv_a_proj_with_mqa(x); [k_nope, v] per head =
  kv_b_proj(RMSNorm(c_kv)); the layouts are megatron's (per head [nope, rope] and
  [nope, v]), so every weight is a plain column/row split.
* rotary on the rope dims: DeepSeek checkpoints store them as interleaved pairs. transformers
  rotates pairs (2i, 2i+1) (V2: complex multiply; V3 `rope_interleave=true`: de-interleave,
  then rotate-half); megatron's MLA de-interleaves, then rotates half. The q·k products
  are the same (q and k get the same permutation).
* softmax scale (qk_nope + qk_rope)^-0.5, times mscale(factor, mscale_all_dim)^2 with yarn
  (megatron's formula and transformers' agree). Yarn's frequencies and cos/sin factor are
  transformers' (blocks/rope.py): megatron's YarnRotaryEmbedding needs CUDA and differs
  where only `mscale` is given, so MLA's rotary module is swapped for `HFYarnRotary`.
* the latent norms: transformers builds q_a_layernorm / kv_a_layernorm with eps 1e-6
  whatever rms_norm_eps says, so they get their own norm with that eps here.
* the kv down-projection is kept whole on every TP rank (`DuplicatedLinear`): megatron's
  column-parallel one keeps only each rank's heads' share of the rope key's gradient.

The core attention is the bridge's (blocks/attention.py): q/k head dim differs from the v
head dim, which `ContextParallelAttention` (SDPA) and TE both accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import megatron.core.transformer.multi_latent_attention as megatron_mla
import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_bridge.bridge.features.rope import attention_factor
from megatron_bridge.runtime.blocks.base import Block, register_block
from megatron_bridge.runtime.blocks.rope import rope_inv_freq

LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV2/V3RMSNorm default, used for the latent norms


class LatentRMSNorm:
    """RMSNorm of the q / kv latents with transformers' fixed eps (a module builder)."""

    def __new__(cls, config: Any, hidden_size: int, eps: float | None = None, **kw: Any):
        return WrappedTorchNorm(config=config, hidden_size=hidden_size, eps=LATENT_NORM_EPS)


def yarn_inv_freq(spec: Any) -> tuple[Any, float]:
    """(inverse frequencies, cos/sin factor) of MLA's rope dims: blocks/rope.py's, which are
    transformers' (`head_dim` of an MLA spec is qk_rope_head_dim)."""
    return rope_inv_freq(spec), attention_factor(spec)


class HFYarnRotary(RotaryEmbedding):
    """RotaryEmbedding with transformers' yarn frequencies; returns (emb, cos/sin factor)
    as MLA's yarn branch expects."""

    def __init__(self, spec: Any, kv_channels: int, rotary_base: float = 10000.0, cp_group: Any = None):
        on_gpu = torch.cuda.is_available()
        super().__init__(
            kv_channels, 1.0, rotary_base=rotary_base, use_cpu_initialization=not on_gpu, cp_group=cp_group
        )
        inv, self.attention_factor = yarn_inv_freq(spec)
        self.inv_freq = inv.to(torch.cuda.current_device() if on_gpu else "cpu")

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False):
        return super().forward(max_seq_len, offset, packed_seq), self.attention_factor


class DuplicatedLinear(torch.nn.Module):
    """kv_a_proj_with_mqa whole on every TP rank (megatron's TE spec does the same).

    Its output's rope part is the key shared by every head, used on each rank by that
    rank's heads only, so its gradient must be summed over TP: with sequence parallelism
    megatron's sequence gather does it; without, an all-reduce in backward does it here."""

    def __init__(self, input_size: int, output_size: int, config: Any, init_method: Any):
        super().__init__()
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        w = torch.empty(output_size, input_size, dtype=config.params_dtype, device=device)
        init_method(w)
        self.weight = torch.nn.Parameter(w)
        self.rope_dim = config.qk_pos_emb_head_dim
        self.tp = config.tensor_model_parallel_size
        self.sp = config.sequence_parallel
        # with SP each rank sees its own sequence slice: finalize_model_grads sums over TP
        self.weight.sequence_parallel = self.sp  # type: ignore[attr-defined]

    def forward(self, x):
        out = torch.nn.functional.linear(x, self.weight)
        if self.tp > 1 and not self.sp:
            latent, rope = out.split([out.shape[-1] - self.rope_dim, self.rope_dim], dim=-1)
            out = torch.cat([latent, copy_to_tensor_model_parallel_region(rope)], dim=-1)
        return out, None


class BridgeMLASelfAttention(MLASelfAttention):
    """MLASelfAttention with an unsplit kv down-projection (and transformers' yarn).

    With the local spec's column-parallel kv down-projection megatron gathers the
    latent and the shared rope key over TP and splits the gradient back, so each rank
    keeps only its own heads' share of the rope key's gradient: wrong grads at tp>1
    (the forward is right). `bridge_spec` (a ModuleSpec param) gives the yarn params."""

    def __init__(self, config: Any, *args: Any, bridge_spec: Any = None, **kw: Any):
        super().__init__(config, *args, **kw)
        if config.rope_type == "yarn":
            self.rotary_pos_emb = HFYarnRotary(
                bridge_spec, config.qk_pos_emb_head_dim, rotary_base=config.rotary_base, cp_group=self.pg_collection.cp
            )
        self.linear_kv_down_proj = DuplicatedLinear(
            config.hidden_size, config.kv_lora_rank + config.qk_pos_emb_head_dim, config, config.init_method
        )


def _allow_without_te() -> None:
    """Without Transformer Engine, megatron stubs its classes with mocks, and MLA's
    `isinstance(linear_proj, TELinear)` then raises; give it a class nothing is an instance of."""
    if not isinstance(megatron_mla.TELinear, type):
        megatron_mla.TELinear = type("NoTELinear", (), {})


def mla_config_class(kw: Mapping[str, Any]):
    """TransformerConfig, or MLATransformerConfig when the kwargs ask for MLA."""
    return MLATransformerConfig if kw.get("multi_latent_attention") else TransformerConfig


@register_block
class MultiLatentAttentionBlock(Block):
    name = "multi-latent-attention"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        if not spec.multi_latent_attention:
            return
        kw.update(
            multi_latent_attention=True,
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_head_dim=spec.qk_head_dim,
            qk_pos_emb_head_dim=spec.qk_pos_emb_head_dim,
            v_head_dim=spec.v_head_dim,
            rope_type="rope",
            rotary_base=spec.rotary_base,
            rotary_percent=1.0,
        )
        if spec.rope_type == "yarn":
            p = dict(spec.rope_params)
            kw.update(
                rope_type="yarn",
                rotary_scaling_factor=p["factor"],
                mscale=p.get("mscale") or 1.0,
                mscale_all_dim=p.get("mscale_all_dim") or 0.0,  # the softmax scale's factor
                original_max_position_embeddings=p["original_max_position_embeddings"],
            )

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        if not spec.multi_latent_attention:
            return
        _allow_without_te()
        attn = layer_spec.submodules.self_attention
        attn.module = BridgeMLASelfAttention
        attn.params = {**(attn.params or {}), "bridge_spec": spec}
        sub = attn.submodules
        sub.q_layernorm = LatentRMSNorm
        sub.kv_layernorm = LatentRMSNorm


__all__ = [
    "BridgeMLASelfAttention",
    "DuplicatedLinear",
    "HFYarnRotary",
    "LATENT_NORM_EPS",
    "LatentRMSNorm",
    "MultiLatentAttentionBlock",
    "mla_config_class",
    "yarn_inv_freq",
]
