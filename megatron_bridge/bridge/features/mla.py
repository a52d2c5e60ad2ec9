"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): the description.

config.json's `kv_lora_rank`, `q_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim` and
`v_head_dim` become the spec's MLA fields; what megatron-core's `MLASelfAttention` then
computes, and what the bridge changes in it, is runtime/blocks/mla.py. Refused here: yarn
with `attention_factor` or `truncate=false`, rope types other than default / yarn, V3's
`rope_interleave=false` (rotate-half on the stored order would need a weight permutation:
megatron's MLA de-interleaves the rope dims) and MLA with fewer KV heads than query heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature


@register_feature
class MultiLatentAttention(Feature):
    name = "multi-latent-attention"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        if hf.get("kv_lora_rank") is None:
            return
        q_rank = hf.get("q_lora_rank")
        fields.update(
            multi_latent_attention=True,
            q_lora_rank=int(q_rank) if q_rank else None,
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_head_dim=int(hf["qk_nope_head_dim"]),
            qk_pos_emb_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            head_dim=int(hf["qk_rope_head_dim"]),
        )
        rope = dict(fields.get("rope_params") or ())
        if rope.get("attention_factor") is not None or rope.get("truncate") is False:
            problems.append("yarn with attention_factor or truncate=false is not supported with MLA")
        if fields.get("rope_type") not in ("default", "yarn"):
            problems.append(f"rope_type {fields.get('rope_type')!r} with MLA is not supported (default, yarn are)")
        if hf.get("rope_interleave") is False:
            problems.append(
                "rope_interleave=false (rotate-half on the stored rope dims) is not supported with MLA: "
                "megatron's MLA de-interleaves the rope dims"
            )
        if int(hf.get("num_key_value_heads") or hf["num_attention_heads"]) != int(hf["num_attention_heads"]):
            problems.append("MLA with num_key_value_heads != num_attention_heads is not supported")

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        if not spec.multi_latent_attention:
            return
        cfg.update(
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_head_dim,
            qk_rope_head_dim=spec.qk_pos_emb_head_dim,
            v_head_dim=spec.v_head_dim,
            head_dim=spec.qk_pos_emb_head_dim,
            rope_interleave=True,
        )


__all__ = ["MultiLatentAttention"]
