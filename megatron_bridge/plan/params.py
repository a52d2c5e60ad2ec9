"""Exact parameter counts from the architecture: the whole model, and one rank's shard.

Why exact and not `12·L·h²`: the planner's memory numbers are compared with real tensors
(tests build the HF model and slice it as megatron-core does) and with DeepSpeed's
estimators, and the difference between the rule of thumb and the truth (GQA's smaller K/V,
SwiGLU's third matrix, untied output layers, 128k vocabularies, MoE routers, MLA's latent
projections) is tens of GB per GPU at the sizes this tool is for.

The one description counted is the `BridgeSpec` (bridge/spec.py), the same object the
builder turns into megatron-core modules (the native backend's `count`, backends/native/backend.py).
The spec is frozen and hashable, so it is also the cache key. Layers may differ
(`moe_layer_pattern`: dense-first DeepSeek layers, Qwen2-MoE's `mlp_only_layers`), so every
count is per layer kind and a pipeline stage sums the kinds of the layers it really holds
(`native_shards`: the native backend's `ModelShards`, plan/shards.py, which every per-rank
number is read from).

  per layer  [input norm] · attention · [post-attention norm] · [pre-MLP norm] · MLP or MoE ·
             [post-MLP norm]
  attention  standard: fused QKV (column-parallel) · [q/k norm: per head, or over the whole
             projection] · output projection (row-parallel) · [sinks: one logit per head]
             MLA: q (q_proj, or q_down · q norm · q_up) · kv_down · kv norm · kv_up · output
  MoE        router (+ bias) · E experts · [shared expert (+ its 1×h gate)]
  model      word embedding (vocab-parallel) · [learned positions, GPT] · final norm ·
             output layer (vocab-parallel; absent when tied)

Buffers are not parameters: the expert score-correction bias (DeepSeek-V3/GLM-4.5
`e_score_correction_bias`) is a registered buffer in transformers and megatron-core's
`router.expert_bias` is one too, so neither side counts it. MTP layers are not counted (the
loader skips them; transformers does not build them either).

How a tensor is split over TP decides whether it is divided by `tp` (column/row-parallel
weights, column-parallel biases, per-head tensors, the vocabulary) or replicated (norms over
h, row-parallel biases, the router, learned positions). MLA follows megatron-core's local
spec: the down projections are column-parallel (split), the q/kv latent norms replicated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from megatron_bridge.parallel.dims import padded_vocab_size
from megatron_bridge.plan.shards import BY_ETP, BY_TP, BY_VOCAB, LayerShards, ModelShards, Piece


def linear_bias(m) -> bool:
    """Biases on every linear layer (megatron add_bias_linear: GPT-2/3)."""
    return bool(m.add_bias_linear)


def _norm(m, width: int) -> int:
    """LayerNorm has weight and bias, RMSNorm only a weight."""
    return 2 * width if m.normalization == "LayerNorm" else width


def _glu(m) -> int:
    """fc1 width multiplier: SwiGLU/GeGLU fuses gate and up projections (2·ffn)."""
    return 2 if m.gated_linear_unit else 1


def is_moe_layer(m, index: int) -> bool:
    """Layer `index` has experts: every layer of a MoE model unless its pattern says dense."""
    if not m.num_moe_experts:
        return False
    pattern = m.moe_layer_pattern
    return not pattern or bool(pattern[index])


def moe_layers(m, ids: Sequence[int] | None = None) -> int:
    """How many of the layers `ids` (default: all) are MoE layers."""
    return sum(is_moe_layer(m, i) for i in (range(m.num_layers) if ids is None else ids))


def _attention(m) -> tuple[int, int]:
    """(tp-split, replicated) parameters of one attention block."""
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    bias = linear_bias(m)
    rep = h if bias or m.attention_out_bias else 0  # row-parallel o_proj bias
    if m.multi_latent_attention:
        qd, vd, kv = m.qk_head_dim + m.qk_pos_emb_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            tp = h * m.q_lora_rank + m.q_lora_rank * a * qd
            rep += _norm(m, m.q_lora_rank)
        else:
            tp = h * a * qd
        tp += h * (kv + m.qk_pos_emb_head_dim) + kv * a * (m.qk_head_dim + vd) + a * vd * h
        rep += _norm(m, kv)
    else:
        qkv_out = (a + 2 * g) * d
        tp = h * qkv_out + (a * d) * h  # QKV + output projection
        if bias or m.add_qkv_bias:
            tp += qkv_out  # column-parallel bias: sharded with its weight
        if m.qk_layernorm:
            if m.qk_norm_type == "full":
                tp += _norm(m, a * d) + _norm(m, g * d)  # over the projection: split with its heads
            else:
                rep += 2 * _norm(m, d)
    if m.attention_sinks:
        tp += a  # one sink logit per head
    return tp, rep


def _mlp(m, width: int) -> tuple[int, int]:
    """(tp-split or etp-split, replicated/ep-only) parameters of one MLP of `width`."""
    k = _glu(m)
    split = m.hidden_size * width * k + width * m.hidden_size
    if linear_bias(m) or m.mlp_bias:
        return split + width * k, m.hidden_size  # fc1 bias column-, fc2 bias row-parallel
    return split, 0


def layer_shards(m, moe: bool | None = None) -> LayerShards:
    """One layer's parameters; `moe` picks the kind (default: a MoE layer if the model has
    any, else dense)."""
    return _layer_shards(m, moe_layers(m) > 0 if moe is None else moe)


@lru_cache(maxsize=4096)
def _layer_shards(m, moe: bool) -> LayerShards:
    h = m.hidden_size
    tp, rep = _attention(m)
    rep += (2 * _norm(m, h) if m.pre_norms else 0) + _norm(m, h) * (m.post_attention_norm + m.post_mlp_norm)
    if not moe:
        t, r = _mlp(m, m.ffn_hidden_size)
        return LayerShards(tp=tp + t, rep=rep + r)
    E = m.num_moe_experts
    # Router, replicated over TP and EP; megatron's TopKRouter has a bias with add_bias_linear.
    rep += h * E + (E if m.moe_router_bias or linear_bias(m) else 0)
    fs = m.moe_shared_expert_intermediate_size
    if fs:
        t, r = _mlp(m, fs)
        tp, rep = tp + t, rep + r
        if m.moe_shared_expert_gate:
            rep += h  # shared-expert gate (1 × h, Qwen2-MoE)
    expert_etp, expert_rep = _mlp(m, m.moe_ffn_hidden_size or m.ffn_hidden_size)
    return LayerShards(tp=tp, rep=rep, expert_etp=expert_etp, expert_rep=expert_rep, num_experts=E)


def active_layer_params(m, moe: bool | None = None) -> int:
    """Parameters a token passes through in one layer: for MoE the router, top-k experts
    and the shared expert instead of all E experts."""
    s = layer_shards(m, moe)
    if not s.num_experts:
        return s.total
    return s.tp + s.rep + min(m.moe_router_topk, s.num_experts) * (s.expert_etp + s.expert_rep)


def attention_widths(m) -> tuple[int, int, int]:
    """Widths (all heads) of the Q, K and V that core attention holds. MLA attends with
    the up-projected heads, not the latent: q/k are heads·(qk_head_dim + qk_pos_emb_head_dim)
    wide (the rotary part of k broadcast to every head), v heads·v_head_dim; megatron-core
    materialises these (and CP exchanges them), the latent is only the projections' input."""
    a = m.num_attention_heads
    if m.multi_latent_attention:
        qd = m.qk_head_dim + m.qk_pos_emb_head_dim
        return a * qd, a * qd, a * m.v_head_dim
    return a * m.head_dim, m.num_query_groups * m.head_dim, m.num_query_groups * m.head_dim


def learned_positions(m) -> int:
    """Learned absolute position embeddings (GPT-2/3; replicated over TP)."""
    return m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0


@dataclass(frozen=True)
class ParamCount:
    total: int  # architecture count (unpadded vocab), what HF's numel() sums to
    active: int  # per token: = total for dense models
    embedding: int  # word (+ position) embedding, + output layer when untied
    per_layer: int  # the largest layer kind (a MoE layer in a MoE model)
    padded_vocab: int  # megatron's vocabulary at tp=1
    moe_layers: int = 0  # how many of the layers have experts

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


@lru_cache(maxsize=256)
def _count(m) -> ParamCount:
    h, V, L = m.hidden_size, m.vocab_size, m.num_layers
    n_moe = moe_layers(m)
    kinds = ((True, n_moe), (False, L - n_moe))
    emb = V * h + learned_positions(m) + (0 if m.tie_word_embeddings else V * h)
    final_norm = _norm(m, h)
    total = sum(n * layer_shards(m, moe).total for moe, n in kinds if n) + emb + final_norm
    active = sum(n * active_layer_params(m, moe) for moe, n in kinds if n) + emb + final_norm
    return ParamCount(
        total=total,
        active=active,
        embedding=emb,
        per_layer=max(layer_shards(m, moe).total for moe, n in kinds if n) if L else 0,
        padded_vocab=padded_vocab_size(V, m.make_vocab_size_divisible_by, 1),
        moe_layers=n_moe,
    )


def count(m) -> ParamCount:
    """The whole model's parameters. Embedding/output use the true vocabulary, as HF
    counts them; per-rank shards (`rank_params`) use megatron's padded vocabulary."""
    return _count(m)


def native_shards(m) -> ModelShards:
    """The native description's parameters by stage piece and split (plan/shards.py): what the
    native backend hands the planner (`NativeBackend.shards`)."""
    return _native_shards(m, m.vision_params)  # not in the spec's hash


@lru_cache(maxsize=256)
def _native_shards(m, vision: int) -> ModelShards:
    h = m.hidden_size
    n_moe = moe_layers(m)
    kinds = ((layer_shards(m, True),) if n_moe else ()) + ((layer_shards(m, False),) if n_moe < m.num_layers else ())
    dense_kind = len(kinds) - 1
    word = Piece(vocab=h)
    return ModelShards(
        kinds=kinds,
        layer_kind=tuple(0 if is_moe_layer(m, i) else dense_kind for i in range(m.num_layers)),
        embedding=Piece(vocab=h, rep=learned_positions(m)),
        final=Piece(rep=_norm(m, h)),
        head=word,
        tied=m.tie_word_embeddings,
        vocab_size=m.vocab_size,
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
        vision=vision,
        largest_weights=_largest_weights(m),
    )


def rank_params(
    m,
    *,
    tp: int,
    ep: int = 1,
    etp: int = 1,
    layers: int | Sequence[int],
    first: bool,
    last: bool,
) -> dict[str, float]:
    """Parameters held by one rank of a pipeline stage of a native description (`first`/`last`:
    the stage holds the embedding / the final norm and output layer). `layers` is the stage's
    global layer indices (`ParallelDims.stage_layer_ids`), or a count of contiguous layers
    starting at 0 on the first stage and ending at the last layer otherwise (enough when all
    layers are alike). Returns {"dense": n, "expert": n}; a rank's total is their sum. Any
    backend's model: `Backend.shards(m).rank_params` (plan/shards.py)."""
    return native_shards(m).rank_params(
        tp=tp, ep=ep, etp=etp, layers=stage_ids(m, layers, first), first=first, last=last
    )


def stage_ids(m, layers: int | Sequence[int], first: bool) -> tuple[int, ...]:
    """A stage's global layer indices from themselves or a count (see `rank_params`)."""
    if isinstance(layers, int):
        start = 0 if first else m.num_layers - layers
        return tuple(range(start, start + layers))
    return tuple(layers)


def _largest_weights(m) -> tuple[tuple[str, int], ...]:
    """The candidates for the biggest single weight on one rank (what ZeRO-3 gathers at once):
    the vocab-parallel embedding/output layer, QKV (MLA: its largest projection), fc1, or one
    expert's fc1."""
    h, a, g, d = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    cands: list[tuple[str, int]] = [(BY_VOCAB, h)]
    if m.multi_latent_attention:
        qd = m.qk_head_dim + m.qk_pos_emb_head_dim
        q_in = m.q_lora_rank or h
        cands += [(BY_TP, q_in * a * qd), (BY_TP, m.kv_lora_rank * a * (m.qk_head_dim + m.v_head_dim))]
        cands.append((BY_TP, a * m.v_head_dim * h))
    else:
        cands.append((BY_TP, h * (a + 2 * g) * d))
    n_moe = moe_layers(m)
    if n_moe:
        cands.append((BY_ETP, h * (m.moe_ffn_hidden_size or m.ffn_hidden_size) * _glu(m)))
        if m.moe_shared_expert_intermediate_size:
            cands.append((BY_TP, h * m.moe_shared_expert_intermediate_size * _glu(m)))
    if n_moe < m.num_layers:
        cands.append((BY_TP, h * m.ffn_hidden_size * _glu(m)))
    return tuple(cands)


def largest_layer(m, *, tp: int, ep: int = 1, etp: int = 1) -> float:
    """The biggest single weight on one rank of a native description (any backend's:
    `Backend.shards(m).largest`)."""
    return native_shards(m).largest(tp=tp, ep=ep, etp=etp)
