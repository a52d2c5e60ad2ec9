"""The transformers backend's `ModelShards` (plan/shards.py): its meta-device model's parameters by
stage piece and split, counted once per description and handed to the planner as plain numbers.

Each parameter (persistent buffers are not parameters) goes where the builder puts it
(`checkpoint.pieces`: a layer, the first stage's pieces, the vision tower and projector, the
final pieces, the LM head, every stage) and splits as its TP kind says (`plan.tensor_kinds`):
`vocab` rows over TP after padding, `column`/`row`/`head` divided by tp, the rest whole. An
experts tensor the ep plan stacks (`grouped_gemm`) holds every expert on dim 0: E/ep of them on
a rank, each divided by etp (= tp, transformers' `moe_tp_experts`) where the tp plan splits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from megatron_bridge.backends.transformers import checkpoint
from megatron_bridge.backends.transformers.adapters import adapter_names
from megatron_bridge.backends.transformers.experts import expert_split
from megatron_bridge.backends.transformers.meta import Meta, meta, transformers_config
from megatron_bridge.backends.transformers.plan import COLUMN, EP_TENSOR, HEAD, MOE_TP, ROW, VOCAB
from megatron_bridge.bridge.lora import resolve_targets
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Mapping as Row
from megatron_bridge.plan.shards import BY_EP, BY_EP_ETP, BY_TP, BY_VOCAB, WHOLE, LayerShards, ModelShards, Piece

SPLIT = (COLUMN, ROW, HEAD)  # kinds divided by tp


def _expert(m: Meta, spec: BridgeSpec, name: str) -> tuple[bool, bool]:
    """(stacked over EP, split over etp) of tensor `name`."""
    stacked = spec.is_moe and m.plan.ep_style(name) == EP_TENSOR and m.shapes[name][:1] == (spec.num_moe_experts,)
    split = expert_split(name, m.plan.style(name)) is not None and m.plan.style(name.rpartition(".")[0]) == MOE_TP
    return stacked, split


def _add(piece: Piece, m: Meta, spec: BridgeSpec, name: str) -> Piece:
    n, shape = m.numel(name), m.shapes[name]
    kind = m.kinds[name]
    if kind == VOCAB and shape and shape[0] == spec.vocab_size:
        return Piece(piece.vocab + n // spec.vocab_size, piece.tp, piece.rep)
    if kind in SPLIT or kind == VOCAB:
        return Piece(piece.vocab, piece.tp + n, piece.rep)
    return Piece(piece.vocab, piece.tp, piece.rep + n)


def _layer(m: Meta, spec: BridgeSpec, names: list[str]) -> LayerShards:
    tp = rep = etp = erep = 0
    E = spec.num_moe_experts or 0
    for name in names:
        n = m.numel(name)
        stacked, split = _expert(m, spec, name)
        if stacked:
            etp, erep = (etp + n // E, erep) if split else (etp, erep + n // E)
        elif m.kinds[name] in SPLIT or split:
            tp += n
        else:
            rep += n
    return LayerShards(tp=tp, rep=rep, expert_etp=etp, expert_rep=erep, num_experts=E if etp or erep else 0)


def _largest(m: Meta, spec: BridgeSpec, names: list[str]) -> tuple[tuple[str, int], ...]:
    """The biggest weight of each split: what ZeRO-3 gathers at once is the largest of them on a rank."""
    best: dict[str, int] = {}
    for name in names:
        n, shape = m.numel(name), m.shapes[name]
        stacked, split = _expert(m, spec, name)
        if m.kinds[name] == VOCAB and shape and shape[0] == spec.vocab_size:
            how, n = BY_VOCAB, n // spec.vocab_size
        elif stacked:
            how = BY_EP_ETP if split else BY_EP
        elif m.kinds[name] in SPLIT or split:
            how = BY_TP
        else:
            how = WHOLE
        best[how] = max(best.get(how, 0), n)
    return tuple(sorted(best.items()))


@lru_cache(maxsize=16)
def shards(spec: BridgeSpec) -> ModelShards:
    """The model's `ModelShards`, from its meta model (once per description)."""
    m = meta(spec)
    names = m.parameters
    where = checkpoint.pieces(m, transformers_config(spec), names)
    per_layer: dict[int, list[str]] = {}
    pieces = {checkpoint.PRE: Piece(), checkpoint.POST: Piece(), checkpoint.LM_HEAD: Piece(), checkpoint.EVERY: Piece()}
    vision = 0
    for name in names:
        at = where[name]
        if isinstance(at, int):
            per_layer.setdefault(at, []).append(name)
        elif any(name == p or name.startswith(p + ".") for p in m.plan.vision):
            vision += m.numel(name)
        else:
            pieces[at] = _add(pieces[at], m, spec, name)
    head = f"{m.plan.head}.weight"
    tied = spec.tie_word_embeddings and head not in m.shapes
    if tied:  # the head is the embedding's weight, held again on a last stage that is not the first
        pieces[checkpoint.LM_HEAD] = _add(Piece(), m, spec, f"{m.plan.embed}.weight")
    layers = [_layer(m, spec, per_layer.get(i, [])) for i in range(spec.num_layers)]
    kinds = tuple(dict.fromkeys(layers))
    return ModelShards(
        kinds=kinds,
        layer_kind=tuple(kinds.index(x) for x in layers),
        embedding=pieces[checkpoint.PRE],
        final=pieces[checkpoint.POST],
        head=pieces[checkpoint.LM_HEAD],
        tied=tied,
        vocab_size=spec.vocab_size,
        make_vocab_size_divisible_by=spec.make_vocab_size_divisible_by,
        vision=vision,
        every=pieces[checkpoint.EVERY],
        largest_weights=_largest(m, spec, names),
    )


def adapter_params(
    spec: BridgeSpec, table: Sequence[Row], peft: Any, *, tp: int, layers: Sequence[int], first: bool
) -> tuple[float, float]:
    """LoRA parameters (dense, expert) on one rank of the stage holding `layers` (`first`: and the
    first stage's pieces: a VLM's vision linears, whole): per adapted linear of shape (out, in)
    and each of its HF inputs, A is rank × in and B out × rank, B's rows ÷ tp on a column-parallel
    linear, A's columns on a row-parallel one. The experts' stacked tensors take no adapters."""
    m = meta(spec)
    where = checkpoint.pieces(m, transformers_config(spec), list(m.shapes))
    held = set(layers)
    r, dense = peft.rank, 0.0
    for t in resolve_targets(table, list(peft.target_modules), spec.family, adapter_names):  # PEFT's module names
        template = t.mapping.megatron
        names = [template.replace("{layer}", str(i)) for i in layers] if "{layer}" in template else [template]
        for name in names:
            at = where.get(name)
            if name not in m.shapes or not (at in held if isinstance(at, int) else at == checkpoint.PRE and first):
                continue
            out, fan_in = m.shapes[name][0], m.shapes[name][-1]
            share = out * len(t.srcs) / len(t.mapping.hf)  # the adapted inputs' rows of the weight
            split = 1 if t.whole else tp
            a = r * fan_in * len(t.srcs) / (1 if t.column or t.whole else split)
            b = r * share / (split if t.column else 1)
            dense += a + b
    return dense, 0.0


__all__ = ["adapter_params", "shards"]
