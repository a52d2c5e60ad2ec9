"""Exact parameter counts from the architecture: the whole model, and one rank's shard.

Why exact and not `12·L·h²`: the planner's memory numbers are compared with real tensors
(tests build the HF model and slice it as megatron-core does) and with DeepSpeed's
estimators, and the difference between the rule of thumb and the truth (GQA's smaller K/V,
SwiGLU's third matrix, untied output layers, 128k vocabularies, MoE routers) is tens of
GB per GPU at the sizes this tool is for.

Layout follows megatron-core's GPTModel, which is also the HF layout for the supported
families (Llama/Mistral/Qwen2/Qwen3 ≙ `LlamaForCausalLM`, GPT ≙ `GPT2LMHeadModel`,
Mixtral/Qwen2-MoE ≙ their HF classes):

  per layer  input norm · QKV (fused, column-parallel) · [q/k norm] · output projection
             (row-parallel) · pre-MLP norm · MLP (fc1 column-, fc2 row-parallel; SwiGLU's
             fc1 is 2·ffn wide) or MoE (router + E experts + optional shared expert)
  model      word embedding (vocab-parallel) · [learned positions, GPT] · final norm ·
             output layer (vocab-parallel; absent when tied)

Biases: GPT-2/3-style models (`model.add_bias_linear`, as the `gpt` model groups set it)
have biases on every linear layer; the Llama-style families have none except Qwen2's QKV
bias (`model.add_qkv_bias`). Learned absolute positions: `model.position_embedding_type`.
These are the same fields the builder passes to megatron-core, so what is counted is built. How a tensor is split over TP decides whether it is
divided by `tp` (column/row-parallel weights, column-parallel biases, the vocabulary) or
replicated (norms, row-parallel biases, the router, learned positions).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megatron_bridge.config.schema import ModelConfig
from megatron_bridge.parallel.dims import padded_vocab_size


def linear_bias(m) -> bool:
    """Biases on every linear layer (megatron add_bias_linear: GPT-2/3)."""
    return bool(m.add_bias_linear)


def _norm(m, width: int) -> int:
    """LayerNorm has weight and bias, RMSNorm only a weight."""
    return 2 * width if m.normalization == "LayerNorm" else width


def _glu(m) -> int:
    """fc1 width multiplier: SwiGLU/GeGLU fuses gate and up projections (2·ffn)."""
    return 2 if m.gated_linear_unit else 1


@dataclass(frozen=True)
class LayerShards:
    """One transformer layer's parameters, grouped by how megatron-core shards them.

    tp: divided by tp.  rep: replicated on every TP rank.  For MoE layers the experts are
    counted per expert: `expert_etp` is divided by etp (and the E experts by ep),
    `expert_rep` (row-parallel expert biases) only by ep.
    """

    tp: int
    rep: int
    expert_etp: int = 0
    expert_rep: int = 0
    num_experts: int = 0

    @property
    def total(self) -> int:
        return self.tp + self.rep + self.num_experts * (self.expert_etp + self.expert_rep)

    def on_rank(self, tp: int, ep: int, etp: int) -> dict[str, float]:
        """Parameters of this layer held by one rank: dense (sharded over dp·cp by the
        distributed optimizer) and expert (sharded over expert-dp)."""
        dense = self.tp / tp + self.rep
        expert = (self.num_experts / ep) * (self.expert_etp / etp + self.expert_rep) if self.num_experts else 0.0
        return {"dense": dense, "expert": expert}


def layer_shards(m) -> LayerShards:
    m = _Frozen.of(m)
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_dim
    bias = linear_bias(m)
    qkv_out = (a + 2 * g) * d
    tp_part = h * qkv_out + (a * d) * h  # QKV + output projection
    if bias or m.add_qkv_bias:
        tp_part += qkv_out  # column-parallel bias: sharded with its weight
    rep = 2 * _norm(m, h)  # input norm + pre-MLP norm
    if bias:
        rep += h  # row-parallel output-projection bias: replicated
    if m.qk_layernorm:
        rep += 2 * _norm(m, d)
    if not m.num_moe_experts:
        f = m.ffn_hidden_size
        tp_part += h * f * _glu(m) + f * h
        if bias:
            tp_part += f * _glu(m)
            rep += h
        return LayerShards(tp=tp_part, rep=rep)
    E, fm = m.num_moe_experts, m.moe_ffn_hidden_size or m.ffn_hidden_size
    rep += h * E  # router (no bias), replicated over TP and EP
    fs = m.moe_shared_expert_intermediate_size
    if fs:
        tp_part += h * fs * _glu(m) + fs * h
        if m.moe_shared_expert_gate:
            rep += h  # shared-expert gate (1 × h, Qwen2-MoE)
    expert_etp = h * fm * _glu(m) + fm * h + (fm * _glu(m) if bias else 0)
    return LayerShards(tp=tp_part, rep=rep, expert_etp=expert_etp, expert_rep=h if bias else 0, num_experts=E)


def active_layer_params(m) -> int:
    """Parameters a token passes through in one layer: for MoE the router, top-k experts
    and the shared expert instead of all E experts."""
    s = layer_shards(m)
    if not s.num_experts:
        return s.total
    return s.tp + s.rep + min(m.moe_router_topk, s.num_experts) * (s.expert_etp + s.expert_rep)


def learned_positions(m) -> int:
    """Learned absolute position embeddings (GPT-2/3; replicated over TP)."""
    return m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0


@dataclass(frozen=True)
class ParamCount:
    total: int  # architecture count (unpadded vocab), what HF's numel() sums to
    active: int  # per token: = total for dense models
    embedding: int  # word (+ position) embedding, + output layer when untied
    per_layer: int
    padded_vocab: int  # megatron's vocabulary at tp=1

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def count(m) -> ParamCount:
    """The whole model's parameters. Embedding/output use the true vocabulary, as HF
    counts them; per-rank shards (`rank_params`) use megatron's padded vocabulary."""
    m = _Frozen.of(m)
    h, V = m.hidden_size, m.vocab_size
    layer = layer_shards(m).total
    emb = V * h + learned_positions(m) + (0 if m.tie_word_embeddings else V * h)
    final_norm = _norm(m, h)
    total = m.num_layers * layer + emb + final_norm
    active = m.num_layers * active_layer_params(m) + emb + final_norm
    return ParamCount(
        total=total,
        active=active,
        embedding=emb,
        per_layer=layer,
        padded_vocab=padded_vocab_size(V, m.make_vocab_size_divisible_by, 1),
    )


@lru_cache(maxsize=8192)
def _rank_params_cached(m, tp, ep, etp, layers, first, last) -> dict[str, float]:
    h = m.hidden_size
    shard = layer_shards(m).on_rank(tp, ep, etp)
    dense, expert = shard["dense"] * layers, shard["expert"] * layers
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    word = vocab * h / tp
    if first:
        dense += word + learned_positions(m)
    if last:
        dense += _norm(m, h)
        # The output layer: its own weight when untied; when tied and the last stage is
        # not the first, megatron keeps a copy of the word embedding there (its gradient
        # is all-reduced with the first stage's).
        if not m.tie_word_embeddings or not first:
            dense += word
    return {"dense": dense, "expert": expert}


def rank_params(m, *, tp: int, ep: int = 1, etp: int = 1, layers: int, first: bool, last: bool) -> dict[str, float]:
    """Parameters held by one rank of a pipeline stage with `layers` transformer layers
    (`first`/`last`: the stage holds the embedding / the final norm and output layer).
    Returns {"dense": n, "expert": n}; a rank's total is their sum. Do not mutate."""
    return _rank_params_cached(_Frozen.of(m), tp, ep, etp, layers, first, last)


def largest_layer(m, *, tp: int, ep: int = 1, etp: int = 1) -> float:
    """The biggest single weight on one rank (what ZeRO-3 gathers at once): the
    vocab-parallel embedding/output layer, QKV, fc1, or one expert's fc1."""
    m = _Frozen.of(m)
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_dim
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    cands = [vocab * h / tp, h * (a + 2 * g) * d / tp]
    if m.num_moe_experts:
        fm = m.moe_ffn_hidden_size or m.ffn_hidden_size
        cands.append(h * fm * _glu(m) / etp)
        if m.moe_shared_expert_intermediate_size:
            cands.append(h * m.moe_shared_expert_intermediate_size * _glu(m) / tp)
    else:
        cands.append(h * m.ffn_hidden_size * _glu(m) / tp)
    return max(cands)


@dataclass(frozen=True)
class _Frozen:
    """Hashable snapshot of the ModelConfig fields the counts read (for lru_cache)."""

    name: str
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    make_vocab_size_divisible_by: int
    tie_word_embeddings: bool
    gated_linear_unit: bool
    normalization: str
    add_bias_linear: bool
    position_embedding_type: str
    add_qkv_bias: bool
    qk_layernorm: bool
    num_moe_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_shared_expert_intermediate_size: int
    moe_shared_expert_gate: bool

    # Same derived sizes as the config it copies (one definition, in config/schema.py).
    kv_heads = ModelConfig.kv_heads
    head_dim = ModelConfig.head_dim

    @classmethod
    def of(cls, m) -> _Frozen:
        """The counted model is the one the builder builds: the spec of the ModelConfig
        (`bridge.hf_config.spec_from_model_config`, family settings such as Qwen2's QKV bias
        included), with the ModelConfig's name."""
        if isinstance(m, cls):
            return m
        from megatron_bridge.bridge.hf_config import spec_from_model_config

        spec = spec_from_model_config(m)
        vals = {f: getattr(spec, f) if hasattr(spec, f) else getattr(m, f) for f in cls.__dataclass_fields__}
        vals.update(num_query_groups=spec.num_query_groups, kv_channels=spec.head_dim)
        return cls(**vals)


def frozen(m) -> _Frozen:
    """A hashable copy of a ModelConfig (the search caches per-model computations)."""
    return _Frozen.of(m)
