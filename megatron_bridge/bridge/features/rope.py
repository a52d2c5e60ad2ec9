"""Rotary position embeddings, exactly as transformers computes them.

One file owns rotary: reading the HF rope settings into the spec, writing them back, the
inverse frequencies (equal to transformers' `ROPE_INIT_FUNCTIONS` for every rope type
accepted), and the megatron modules that apply them.

* Rope types: default, linear, llama3, yarn, longrope, dynamic. Frequencies that depend on
  the sequence length (longrope: short factors up to `original_max_position_embeddings`,
  long beyond; dynamic NTK: rescaled past `max_position_embeddings`) are chosen by the
  length megatron's `GPTModel` asks rotary for — the whole sequence under CP, the longest
  sequence of a packed (THD) batch — which is what transformers' `max(position_ids) + 1` is
  for the same batch. transformers' dynamic NTK keeps the longest length it has seen (a
  stateful cache); ours is stateless, so the two agree for any fixed sequence length and
  for every length <= max_position_embeddings, but not for a model fed growing then
  shrinking lengths above it.
* Attention factor (yarn's mscale, longrope's scaling): transformers multiplies cos and sin
  by it, i.e. scales the rotated part of q and k; `RopeSelfAttention` does exactly that
  (rotation is linear, so scaling before it is the same). megatron's own yarn path reads it
  from an MLA config only.
* Partial rotary (`partial_rotary_factor` -> `rotary_percent`): only the first
  rotary_percent·head_dim dims rotate (megatron slices by the frequency width).
* Interleaved rotary (GLM): pairs (2i, 2i+1) rotate; megatron's `rotary_interleaved`
  computes what transformers' Glm4 `apply_rotary_pos_emb` does. No HF key: a family sets it.
* Per-layer rope base (`rope_local_base`, Gemma 3): sliding-window layers use default rope
  with their own base; each such layer's `RopeSelfAttention` computes its own embedding of
  the same length, sliced per CP rank exactly as the model-wide one.
* NoPE layers (`nope_pattern`; HF `no_rope_layers`, where 1 means *use* rope): megatron's
  `no_rope_freq` list skips rotary in those layers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.features.base import Feature, register_feature

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
_KEEP = {  # rope_parameters keys that matter per type (transformers' validators' lists)
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
    "longrope": ("short_factor", "long_factor", "factor", "attention_factor", "original_max_position_embeddings"),
}
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}
_LAYER_KINDS = ("full_attention", "sliding_attention")


def _hashable(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def read_rope(hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
    """rotary_base, rope_type, rope_params, rotary_percent, rope_local_base from
    transformers-5 `rope_parameters` (flat, or nested per layer type) or v4 `rope_scaling`."""
    raw = dict(hf.get("rope_parameters") or {})
    local: float | None = hf.get("rope_local_base_freq")
    if any(k in raw for k in _LAYER_KINDS):  # nested: {"full_attention": {...}, "sliding_attention": {...}}
        full, sliding = dict(raw.get("full_attention") or {}), raw.get("sliding_attention")
        if sliding and dict(sliding) != full:
            if (sliding.get("rope_type") or sliding.get("type") or "default") != "default":
                problems.append("a scaled rope type on sliding-window layers is not supported (only their base)")
            local = sliding.get("rope_theta", local)
        raw = full
    params = {**raw, **dict(hf.get("rope_scaling") or {})}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    rtype = params.get("rope_type") or params.get("type") or "default"
    if rtype in ("su", "yarn") and params.get("short_factor") is not None:  # Phi-3's old names for longrope
        rtype = "longrope"
    keep: dict[str, Any] = {}
    if rtype not in ROPE_TYPES:
        problems.append(f"rope_type {rtype!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    else:
        missing = [k for k in _REQUIRED.get(rtype, ()) if params.get(k) is None]
        if missing:
            problems.append(f"{rtype} rope scaling without {', '.join(map(repr, missing))}")
        keep = {k: _hashable(params[k]) for k in _KEEP[rtype] if params.get(k) is not None}
        if "original_max_position_embeddings" in _KEEP[rtype]:
            # transformers: a top-level value wins (Phi-3), else the rope dict's, else max_position_embeddings
            omax = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
            keep["original_max_position_embeddings"] = int(omax or hf.get("max_position_embeddings") or 2048)
    if params.get("mrope_section") is not None:
        problems.append("multimodal rope (mrope_section) is not supported")
    if params.get("llama_4_scaling_beta"):
        keep["llama_4_scaling_beta"] = float(params["llama_4_scaling_beta"])
    partial = hf.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    fields["rotary_percent"] = float(partial) if partial is not None else 1.0
    fields["rotary_base"], fields["rope_type"] = float(theta), rtype
    fields["rope_params"] = tuple(sorted(keep.items()))
    # sliding layers run *default* rope at their base: the same as the model's only when that is default too
    same = local is not None and float(local) == float(theta) and rtype == "default"
    fields["rope_local_base"] = float(local) if local is not None and not same else None


def read_nope(hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
    """`no_rope_layers` (SmolLM3, Llama 4): 1 = the layer *uses* rope, 0 = NoPE."""
    flags = hf.get("no_rope_layers")
    n = int(hf.get("num_hidden_layers") or 0)
    if flags is None:  # the family's reader may have set its own default (SmolLM3's interval)
        fields.setdefault("nope_pattern", ())
        return
    fields["nope_pattern"] = ()
    if len(flags) < n:
        problems.append(f"no_rope_layers has {len(flags)} entries for {n} layers")
        return
    pattern = tuple(0 if int(f) else 1 for f in list(flags)[:n])
    fields["nope_pattern"] = pattern if any(pattern) else ()


# ----------------------------------------------------------------------------------------
# frequencies (transformers' modeling_rope_utils, line for line where it matters)
# ----------------------------------------------------------------------------------------


def rotary_dim(spec: Any) -> int:
    return int(spec.head_dim * spec.rotary_percent)


def _default_inv_freq(base: float, dim: int):
    import torch

    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(spec: Any, seq_len: int | None = None):
    """Inverse frequencies as transformers computes them for `spec`'s rope type, for a batch
    whose longest sequence has `seq_len` tokens (None: at init, i.e. up to the original
    length; only longrope and dynamic depend on it)."""
    import torch

    d, base, p = rotary_dim(spec), spec.rotary_base, dict(spec.rope_params)
    if spec.rope_type == "linear":
        return _default_inv_freq(base, d) / p["factor"]
    if spec.rope_type == "llama3":
        inv = _default_inv_freq(base, d)
        factor, lo, hi, old = (p[k] for k in _KEEP["llama3"])
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
    import torch

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


def attention_factor(spec: Any) -> float:
    """transformers' `attention_scaling` (cos and sin are multiplied by it)."""
    p = dict(spec.rope_params)
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    if spec.rope_type == "yarn":

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        f = p["factor"]
        if p.get("mscale") and p.get("mscale_all_dim"):
            return float(mscale(f, p["mscale"]) / mscale(f, p["mscale_all_dim"]))
        return mscale(f)
    if spec.rope_type == "longrope":
        omax = p["original_max_position_embeddings"]
        f = p.get("factor") or spec.max_position_embeddings / omax
        return 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(omax))
    return 1.0


def layer_rope(spec: Any, index: int) -> dict[str, Any] | None:
    """What global layer `index` needs beyond the model-wide rotary embedding (None: nothing):
    {"base": own default-rope base or None, "scale": attention factor, "rot": rotary dims}."""
    if spec.nope_pattern and spec.nope_pattern[index]:
        return None
    from megatron_bridge.bridge.features.attention import layer_window

    local = spec.rope_local_base if spec.rope_local_base and layer_window(spec, index) is not None else None
    scale = 1.0 if local else attention_factor(spec)  # local layers: default rope, no scaling
    p = dict(spec.rope_params)
    beta = None if local else p.get("llama_4_scaling_beta")
    if local is None and scale == 1.0 and not beta:
        return None
    omax = p.get("original_max_position_embeddings")
    return {"base": local, "scale": scale, "rot": rotary_dim(spec), "beta": beta, "omax": omax}


# ----------------------------------------------------------------------------------------
# megatron modules
# ----------------------------------------------------------------------------------------


def _rotary_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

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

    return BridgeRotaryEmbedding


def _attention_class():
    from megatron.core.transformer.attention import SelfAttention

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
                self.own_rotary = _rotary_class()(
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
            import torch

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
            import torch

            from megatron_bridge.runtime.cp_attention import cp_positions

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

    return RopeSelfAttention


_CLASSES: dict[str, Any] = {}


def rope_self_attention_class():
    if "attn" not in _CLASSES:
        _CLASSES["attn"] = _attention_class()
    return _CLASSES["attn"]


def bridge_rotary_class():
    if "rotary" not in _CLASSES:
        _CLASSES["rotary"] = _rotary_class()
    return _CLASSES["rotary"]


@register_feature
class Rope(Feature):
    name = "rope"

    @classmethod
    def read(cls, hf: Mapping[str, Any], fields: dict[str, Any], problems: list[str]) -> None:
        read_rope(hf, fields, problems)
        read_nope(hf, fields, problems)

    @classmethod
    def to_hf(cls, spec: Any, cfg: dict[str, Any]) -> None:
        from megatron_bridge.bridge.registry import weight_family

        rope = {"rope_theta": spec.rotary_base, "rope_type": spec.rope_type, **dict(spec.rope_params)}
        rope = {k: list(v) if isinstance(v, tuple) else v for k, v in rope.items()}
        if spec.rotary_percent != 1.0:
            rope["partial_rotary_factor"] = spec.rotary_percent
            cfg["partial_rotary_factor"] = spec.rotary_percent
        if "original_max_position_embeddings" in rope:
            cfg["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
        if spec.rope_local_base:
            local = {"rope_type": "default", "rope_theta": spec.rope_local_base}
            cfg["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        else:
            cfg["rope_parameters"] = rope
        key = weight_family(spec.family).hf_names.get("nope_pattern")
        if spec.nope_pattern or key:
            pattern = spec.nope_pattern or (0,) * spec.num_layers
            cfg[key or "no_rope_layers"] = [0 if nope else 1 for nope in pattern]

    @classmethod
    def config(cls, spec: Any, kw: dict[str, Any]) -> None:
        kw["rotary_interleaved"] = spec.rotary_interleaved
        if spec.nope_pattern:
            kw["no_rope_freq"] = list(spec.nope_pattern)

    @classmethod
    def layer(cls, spec: Any, index: int, layer_spec: Any) -> None:
        from megatron.core.transformer.spec_utils import ModuleSpec

        rope = layer_rope(spec, index)
        if rope is None or spec.position_embedding_type != "rope" or spec.multi_latent_attention:
            return  # MLA rotates its rope dims itself (features/mla.py)
        attn = layer_spec.submodules.self_attention
        params = {**dict(attn.params or {}), "rope": rope, "bridge_spec": spec}
        layer_spec.submodules.self_attention = ModuleSpec(
            module=rope_self_attention_class(), params=params, submodules=attn.submodules
        )

    @classmethod
    def model(cls, spec: Any, chunk: Any) -> None:
        old = getattr(chunk, "rotary_pos_emb", None)
        if old is None or spec.position_embedding_type != "rope":
            return
        chunk.rotary_pos_emb = bridge_rotary_class()(
            spec,
            lambda n: rope_inv_freq(spec, n),
            use_cpu_initialization=True,
            cp_group=old.cp_group,
        )
        chunk.rotary_pos_emb.inv_freq = chunk.rotary_pos_emb.inv_freq.to(old.inv_freq.device)


__all__ = [
    "ROPE_TYPES",
    "Rope",
    "attention_factor",
    "layer_rope",
    "read_rope",
    "rope_inv_freq",
    "rope_self_attention_class",
    "bridge_rotary_class",
]
