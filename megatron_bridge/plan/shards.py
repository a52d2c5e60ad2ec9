"""A model's parameters by where the pipeline holds them and how TP/EP split them: plain numbers.

Every backend hands the planner one `ModelShards` (`Backend.shards`): the native backend from
its per-layer arithmetic over the description (plan/params.py `native_shards`), the transformers
backend from its meta-device model's tensors and tp/ep plans (backends/transformers/shards.py).
Everything per rank — a stage's parameters under tp/ep/etp, the largest weight ZeRO-3 gathers,
how many of a stage's layers have experts — is then the same arithmetic here, whichever backend
counted, and nothing here needs torch.

  layers     one `LayerShards` per layer kind; `layer_kind[i]` is layer i's
  embedding  first stage: the word embedding (vocab-parallel) and what sits before the layers
  vision     first stage: a VLM's vision tower and projector, whole on every TP rank
  final      last stage: the pieces after the layers (the final norm)
  head       last stage: the output layer; a tied one is the embedding (held again only on a last
             stage that is not the first, as megatron and the transformers builder keep it)
  every      on every stage (a model-level parameter no stage piece owns)

A `Piece` splits three ways: `vocab` is its width per vocabulary row (rows padded to the run's
padded vocabulary, then divided by tp), `tp` is divided by tp, `rep` is whole on every TP rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from megatron_bridge.parallel.dims import padded_vocab_size


@dataclass(frozen=True)
class LayerShards:
    """One transformer layer's parameters, grouped by how they are sharded.

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

    def active(self, topk: int) -> int:
        """Parameters a token passes through: the router's top-k experts instead of all E."""
        if not self.num_experts:
            return self.total
        return self.tp + self.rep + min(topk, self.num_experts) * (self.expert_etp + self.expert_rep)


@dataclass(frozen=True)
class Piece:
    """Parameters of a stage piece by split: per vocabulary row, over tp, whole."""

    vocab: int = 0
    tp: int = 0
    rep: int = 0

    def total(self, vocab_size: int) -> int:
        return vocab_size * self.vocab + self.tp + self.rep

    def on_rank(self, tp: int, vocab: int) -> float:
        """On one TP rank, the vocabulary padded to `vocab` rows."""
        return vocab * self.vocab / tp + self.tp / tp + self.rep


# How a largest-weight candidate divides on one rank (`ModelShards.largest`).
BY_VOCAB, BY_TP, BY_ETP, BY_EP, BY_EP_ETP, WHOLE = "vocab", "tp", "etp", "ep", "ep_etp", "whole"


@dataclass(frozen=True)
class ModelShards:
    kinds: tuple[LayerShards, ...]
    layer_kind: tuple[int, ...]  # per global layer index: its kind in `kinds`
    embedding: Piece
    final: Piece
    head: Piece
    tied: bool  # the head is the embedding (one copy when one stage holds both)
    vocab_size: int
    make_vocab_size_divisible_by: int
    vision: int = 0
    every: Piece = Piece()
    largest_weights: tuple[tuple[str, int], ...] = ()  # (how it divides, numel or vocab width)

    @property
    def total(self) -> int:
        """Every parameter once (the true vocabulary, a tied head once), as `numel()` sums."""
        V = self.vocab_size
        layers = sum(self.kinds[k].total for k in self.layer_kind)
        head = 0 if self.tied else self.head.total(V)
        return layers + self.embedding.total(V) + self.vision + self.final.total(V) + head + self.every.total(V)

    def moe_layers(self, ids: Sequence[int] | None = None) -> int:
        """How many of the layers `ids` (default: all) have experts."""
        ids = range(len(self.layer_kind)) if ids is None else ids
        return sum(bool(self.kinds[self.layer_kind[i]].num_experts) for i in ids)

    def rank_params(
        self, *, tp: int, ep: int = 1, etp: int = 1, layers: Sequence[int], first: bool, last: bool
    ) -> dict[str, float]:
        """Parameters held by one rank of a pipeline stage holding global `layers`
        (`first`/`last`: it holds the embedding and vision pieces / the final pieces and
        the output layer). {"dense": n, "expert": n}; a rank's total is their sum. Do not mutate."""
        return _rank_params(self, tp, ep, etp, tuple(layers), first, last)

    def largest(self, *, tp: int, ep: int = 1, etp: int = 1) -> float:
        """The biggest single weight on one rank (what ZeRO-3 gathers at once)."""
        vocab = padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)
        per = {BY_VOCAB: lambda n: vocab * n / tp, BY_TP: lambda n: n / tp, BY_ETP: lambda n: n / etp}
        per |= {BY_EP: lambda n: n / ep, BY_EP_ETP: lambda n: n / ep / etp, WHOLE: lambda n: n}
        return max((per[how](n) for how, n in self.largest_weights), default=0.0)


@lru_cache(maxsize=8192)
def _rank_params(s: ModelShards, tp, ep, etp, ids, first, last) -> dict[str, float]:
    counts: dict[int, int] = {}
    for i in ids:
        counts[s.layer_kind[i]] = counts.get(s.layer_kind[i], 0) + 1
    dense = expert = 0.0
    for k, n in sorted(counts.items()):
        shard = s.kinds[k].on_rank(tp, ep, etp)
        dense, expert = dense + shard["dense"] * n, expert + shard["expert"] * n
    vocab = padded_vocab_size(s.vocab_size, s.make_vocab_size_divisible_by, tp)
    if s.every != Piece():
        dense += s.every.on_rank(tp, vocab)
    if first:
        dense += s.embedding.on_rank(tp, vocab) + s.vision  # a VLM's vision pieces: whole on every TP rank
    if last:
        dense += s.final.on_rank(tp, vocab)
        # The output layer: its own weight when untied; when tied and the last stage is
        # not the first, a copy of the word embedding is kept there (its gradient is
        # all-reduced with the first stage's).
        if not s.tied or not first:
            dense += s.head.on_rank(tp, vocab)
    return {"dense": dense, "expert": expert}


__all__ = ["BY_EP", "BY_EP_ETP", "BY_ETP", "BY_TP", "BY_VOCAB", "WHOLE", "LayerShards", "ModelShards", "Piece"]
