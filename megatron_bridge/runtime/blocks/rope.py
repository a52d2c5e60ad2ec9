"""Rotary position embeddings' build hooks: transformers' inverse frequencies and the megatron
modules that apply them (the description — rope types, what each layer needs — is
bridge/features/rope.py).

* Frequencies that depend on the sequence length (longrope: short factors up to
  `original_max_position_embeddings`, long beyond; dynamic NTK: rescaled past
  `max_position_embeddings`) are chosen by the length megatron's `GPTModel` asks rotary
  for — the whole sequence under CP, the longest sequence of a packed (THD) batch — which
  is what transformers' `max(position_ids) + 1` is for the same batch.
* `BridgeRotaryEmbedding` replaces the model-wide rotary module of every chunk (`model`).
* `RopeSelfAttention` (`layer`, where `layer_rope` asks for anything) multiplies the rotated
  dims of q and k by the attention factor (yarn's mscale, longrope's scaling), applies
  Ministral-3's `llama_4_scaling_beta` query scale, and computes its own rotary embedding
  where the layer has its own base (Gemma 3's sliding layers), sliced per CP rank exactly as
  the model-wide one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_bridge.bridge.features.rope import layer_rope, rotary_dim
from megatron_bridge.runtime.blocks.base import Block, register_block
from megatron_bridge.runtime.cp_attention import cp_positions

# ----------------------------------------------------------------------------------------
# frequencies (transformers' modeling_rope_utils, line for line where it matters)
# ----------------------------------------------------------------------------------------

_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _default_inv_freq(base: float, dim: int):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(spec: Any, seq_len: int | None = None):
    """Inverse frequencies as transformers computes them for `spec`'s rope type, for a batch
    whose longest sequence has `seq_len` tokens (None: at init, i.e. up to the original
    length; only longrope and dynamic depend on it)."""
    d, base, p = rotary_dim(spec), spec.rotary_base, dict(spec.rope_params)
    if spec.rope_type == "linear":
        return _default_inv_freq(base, d) / p["factor"]
    if spec.rope_type == "llama3":
        inv = _default_inv_freq(base, d)
        factor, lo, hi, old = (p[k] for k in _LLAMA3)
        low_wl, high_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(base, d, p)
    if spec.rope_type == "longrope":
        long = seq_len is not None and seq_len > p["original_max_position_embeddings"]
        ext = torch.tensor(p["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if spec.rope_type == "dynamic":
        mp, factor = spec.max_position_embeddings, p["factor"]
        n = max(seq_len or mp, mp)
        base = base * ((factor * n / mp) - (factor - 1)) ** (d / (d - 2))
        return _default_inv_freq(base, d)
    return _default_inv_freq(base, d)


def _yarn_inv_freq(base: float, dim: int, p: dict[str, Any]):
    factor, omax = p["factor"], p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rot):
        return (dim * math.log(omax / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extra = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra


# ----------------------------------------------------------------------------------------
# megatron modules
# ----------------------------------------------------------------------------------------


class BridgeRotaryEmbedding(RotaryEmbedding):
    """megatron's RotaryEmbedding with transformers' frequencies for the asked length.
    (megatron caches `forward` per length, which is right: the frequencies are a
    function of the length.)"""

    def __init__(self, spec, inv_freq_fn, **kw):
        super().__init__(
            kv_channels=spec.head_dim,
            rotary_percent=spec.rotary_percent,
            rotary_interleaved=spec.rotary_interleaved,
            **kw,
        )
        self.inv_freq_fn = inv_freq_fn
        device = self.inv_freq.device  # type: ignore[has-type]  # set by RotaryEmbedding.__init__
        self.inv_freq = inv_freq_fn(None).to(device)

    def forward(self, max_seq_len, offset=0, packed_seq=False, cp_group=None):
        self.inv_freq = self.inv_freq_fn(max_seq_len).to(self.inv_freq.device)
        return super().forward(max_seq_len, offset, packed_seq, cp_group)


class RopeSelfAttention(SelfAttention):
    """SelfAttention whose layer applies its own rotary (module docstring): its own base
    (Gemma 3 sliding layers) and/or transformers' attention factor on the rotated dims."""

    def __init__(self, config, submodules, layer_number, rope=None, bridge_spec=None, **kw):
        super().__init__(config, submodules, layer_number, **kw)
        self.rope_scale, self.rope_dims = rope["scale"], rope["rot"]
        self.beta, self.omax, self._packed = rope.get("beta"), rope.get("omax"), None
        self.own_rotary = None
        if rope["base"] is not None:
            local = bridge_spec.replace(rotary_base=rope["base"], rope_type="default", rope_params=())
            self.own_rotary = BridgeRotaryEmbedding(
                local,
                lambda n: rope_inv_freq(local, n),
                use_cpu_initialization=config.use_cpu_initialization,
                cp_group=self.pg_collection.cp,
            )

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None, **kw):
        if self.own_rotary is not None and rotary_pos_emb is not None:
            packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
            n = rotary_pos_emb.shape[0] * (1 if packed else self.pg_collection.cp.size())
            cp = packed_seq_params.cp_group if packed_seq_params is not None else None
            rotary_pos_emb = self.own_rotary(n, packed_seq=packed, cp_group=cp)
        self._packed = packed_seq_params
        return super().forward(
            hidden_states, *args, rotary_pos_emb=rotary_pos_emb, packed_seq_params=packed_seq_params, **kw
        )

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        out = super().get_query_key_value_tensors(hidden_states, key_value_states, output_gate, split_qkv)
        if not split_qkv:
            return out
        q, k = out[0], out[1]
        if self.rope_scale != 1.0:
            r = self.rope_dims
            q = torch.cat([q[..., :r] * self.rope_scale, q[..., r:]], dim=-1)
            k = torch.cat([k[..., :r] * self.rope_scale, k[..., r:]], dim=-1)
        if self.beta:
            q = q * self._llama4_scale(q).to(q.dtype)
        return (q, k, *out[2:])

    def _llama4_scale(self, q):
        """Ministral-3's query scale 1 + beta·log(1 + floor(pos / original_max)) at each
        token's position (global under CP, restarting per packed sequence)."""
        cp = self.pg_collection.cp
        if self._packed is not None:
            if cp.size() > 1:
                raise NotImplementedError("llama_4_scaling_beta with packed sequences under cp > 1")
            cu = self._packed.cu_seqlens_q.long().to(q.device)
            lengths = cu[1:] - cu[:-1]
            pos = torch.arange(q.shape[0], device=q.device) - torch.repeat_interleave(cu[:-1], lengths)
        else:
            pos = cp_positions(q.shape[0], cp.size(), cp.rank(), q.device)
        scale = 1 + self.beta * torch.log(1 + torch.floor(pos / self.omax))
        return scale.view(-1, *([1] * (q.dim() - 1)))


@register_block
class RopeBlock(Block):
    name = "rope"

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        kw["rotary_interleaved"] = spec.rotary_interleaved
        if spec.nope_pattern:
            kw["no_rope_freq"] = list(spec.nope_pattern)

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        rope = layer_rope(spec, index)
        if rope is None or spec.position_embedding_type != "rope" or spec.multi_latent_attention:
            return  # MLA rotates its rope dims itself (blocks/mla.py)
        attn = layer_spec.submodules.self_attention
        params = {**dict(attn.params or {}), "rope": rope, "bridge_spec": spec}
        layer_spec.submodules.self_attention = ModuleSpec(
            module=RopeSelfAttention, params=params, submodules=attn.submodules
        )

    @classmethod
    def model(cls, spec: Any, chunk: Any) -> None:
        old = getattr(chunk, "rotary_pos_emb", None)
        if old is None or spec.position_embedding_type != "rope":
            return
        chunk.rotary_pos_emb = BridgeRotaryEmbedding(
            spec,
            lambda n: rope_inv_freq(spec, n),
            use_cpu_initialization=True,
            cp_group=old.cp_group,
        )
        chunk.rotary_pos_emb.inv_freq = chunk.rotary_pos_emb.inv_freq.to(old.inv_freq.device)


__all__ = ["BridgeRotaryEmbedding", "RopeBlock", "RopeSelfAttention", "rope_inv_freq"]
