"""The transformers backend's stacked experts and their checkpoint tensors (torch-free at import).

transformers 5 keeps a MoE layer's experts stacked in memory (`mlp.experts.gate_up_proj [E,
2I, H]`, `mlp.experts.down_proj [E, H, I]`) but `save_pretrained` writes them one tensor per
expert and projection (`mlp.experts.3.gate_proj.weight`, Mixtral's `experts.3.w1.weight`), by
the model's weight converters: `MergeModulelist(dim=0)` (stack the experts) and, for a fused
gate/up, `Concatenate(dim=1)` (the projections end to end in each expert's slab). `stacked`
reads exactly those converters, so a chunk's stacked tensor is one table row whose HF tensors
are every expert's pieces in order, laid out by `StackedExperts`; any other converter is still
refused (backends/transformers/backend.py `checkpoint_names`).

Under expert parallelism a rank holds experts [r·E/ep, (r+1)·E/ep) (runtime/transformers/experts.py):
the loader hands `StackedExperts.shard` only those experts' HF tensors (`ep_part`), so a rank
reads only its experts' bytes; export gathers the stacked tensor over EP and `merge` splits it
back into every expert's tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import prod
from typing import Any, NamedTuple

from megatron_bridge.backends.transformers.plan import EP_MODULE, MOE_IDENTITY, MOE_TP
from megatron_bridge.bridge.layout import ep_part
from megatron_bridge.bridge.mapping import NotBlockwise, Transform
from megatron_bridge.bridge.shards import Block, Shapes, Shard, Sliceable, split_range

# config attributes that count routed experts / experts per token, in the families' spellings
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
EXPERTS_PER_TOKEN_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# the converters' operations (loading direction) that stack per-expert tensors, by op and dim
STACK_OPS = ((("MergeModulelist", 0),), (("MergeModulelist", 0), ("Concatenate", 1)))


class StackedExperts(Transform):
    """Every expert's `pieces` HF tensors (expert-major) <-> one stacked tensor [E, rows, cols]:
    expert e's slab is its pieces concatenated on dim 0. Over TP (transformers'
    `moe_tp_experts`) each piece is split as its stacked tensor's plan says: `packed_colwise`
    (the fused gate/up: each piece's rows, so a rank keeps its gate rows then its up rows) or
    `rowwise` (the columns); over EP the loader passes a run of whole experts."""

    def __init__(self, experts: int, pieces: int, split: str | None = None) -> None:
        self.experts, self.pieces, self.n_hf, self.split = experts, pieces, experts * pieces, split
        self.whole = split is None  # unsplit: every TP rank holds it all

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> Any:
        raise NotBlockwise("stacked experts are built from whole per-expert tensors, not blocks")

    def _part(self, t: Any, s: Shard) -> Any:
        if self.split == "column":
            a, b = split_range(t.shape[0], s, "expert rows")
            return t[a:b]
        if self.split == "row":
            a, b = split_range(t.shape[1], s, "expert columns")
            return t[:, a:b]
        return t[:]

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> Any:
        import torch

        if len(hf) % self.pieces:  # unsplit (a vision tower's experts): whole on every TP rank
            raise ValueError(f"{self!r}: {len(hf)} tensors, not whole experts")
        parts = [self._part(t, s) for t in hf]
        slabs = [torch.cat(parts[i : i + self.pieces], 0) for i in range(0, len(parts), self.pieces)]
        return torch.stack(slabs, 0)

    def merge(self, shards: Sequence[Any], shapes: Shapes) -> tuple[Any, ...]:
        import torch

        dim = 1 if self.split == "row" else 0
        whole = shards if self.split else shards[:1]  # unsplit: every TP rank holds it all
        per_rank = [[slab.chunk(self.pieces, 0) for slab in t] for t in whole]  # [tp][expert][piece]
        return tuple(
            torch.cat([r[e][p] for r in per_rank], dim).clone()
            for e in range(len(shards[0]))
            for p in range(self.pieces)
        )

    def __repr__(self) -> str:
        return f"StackedExperts({self.experts}x{self.pieces}, {self.split})"


class WholeStackedExperts(Transform):
    """A stacked experts tensor the checkpoint already holds stacked ([E, rows, cols]: Granite-MoE's
    `input_linear.weight` renamed to `experts.gate_up_proj`, Llama 4's and Aria's transposed
    `gate_up_proj [E, H, 2·I]`), split over TP along its intermediate dim as `ExpertSplit` says:
    dim 1 ("column") or dim 2 ("row") in `packs` equal blocks (a fused gate/up is 2), this rank's
    part of each. EP takes whole experts (dim 0) after (runtime/transformers/weights.py)."""

    def __init__(self, split: str, packs: int) -> None:
        self.split, self.packs, self.dim = split, packs, SPLIT_DIMS[split]

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> list[Block]:
        """One strided block: the tensor read as rows of w·(what follows dim d) elements, where
        w is a rank's width of one pack, is per (expert, ..., pack) the tp ranks' rows in turn,
        so rank r's part is every tp-th row from r; its shard [E, .., packs·w, ..] is those rows
        in order (same bytes). Lets the exporter receive each rank's part straight into place
        (runtime/weights_base.gather_merged)."""
        (sh,) = hf_shapes
        d = self.dim
        if len(sh) != 3 or sh[d] % self.packs:
            raise ValueError(f"{self!r}: a stacked experts tensor [E, rows, cols], got shape {list(sh)}")
        a, b = split_range(sh[d] // self.packs, s, f"expert {self.split}s")
        outer, inner = prod(sh[:d]) * self.packs * s.size, (b - a) * prod(sh[d + 1 :])
        return [Block(0, (s.rank, outer), step=s.size, view=(outer, inner))]

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> Any:
        import torch

        d, what = self.dim, f"expert {self.split}s"
        parts = []
        for blk in hf[0][:].chunk(self.packs, d):
            a, b = split_range(blk.shape[d], s, what)
            parts.append(blk.narrow(d, a, b - a))
        return torch.cat(parts, d)

    def merge(self, shards: Sequence[Any], shapes: Shapes) -> tuple[Any, ...]:

        d = self.dim
        per_rank = [t.chunk(self.packs, d) for t in shards]  # [tp][pack]
        shape = list(shards[0].shape)
        shape[d] *= len(shards)
        out, at = shards[0].new_empty(shape), 0  # one allocation: every block copied into place
        for p in range(self.packs):
            for r in per_rank:
                out.narrow(d, at, r[p].shape[d]).copy_(r[p])
                at += r[p].shape[d]
        return (out,)

    def __repr__(self) -> str:
        return f"WholeStackedExperts({self.split}, packs={self.packs})"


class JoinedStackedExperts(Transform):
    """`pieces` stacked experts tensors a checkpoint holds apart (Step3p7's `moe.gate_proj.weight`
    and `moe.up_proj.weight`, each [E, I, H]) joined along `dim` (transformers' `Concatenate`), then
    split over TP as the model's `moe_tp_experts` splits the joined tensor (`inner`, a
    `WholeStackedExperts`); `merge` joins the ranks' parts and cuts the pieces back as `Chunk` does."""

    def __init__(self, pieces: int, dim: int, inner: Transform) -> None:
        self.n_hf, self.dim, self.inner = pieces, dim, inner

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> Any:
        raise NotBlockwise("stacked experts joined from pieces are read whole")

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> Any:
        import torch

        return self.inner.shard([torch.cat([t[:] for t in hf], self.dim)], s, shapes)

    def merge(self, shards: Sequence[Any], shapes: Shapes) -> tuple[Any, ...]:
        (whole,) = self.inner.merge(shards, shapes)
        return tuple(t.clone() for t in whole.chunk(self.n_hf, self.dim))

    def __repr__(self) -> str:
        return f"JoinedStackedExperts({self.n_hf}, dim={self.dim}, {self.inner!r})"


class TransposedExperts(Transform):
    """A stacked experts tensor a checkpoint may hold with two dims swapped (transformers'
    `Transpose` converter). `held` (transformers' `check_dims`: Qwen3-VL-MoE): the model's
    layout [E, 2·I, H] is what save_pretrained writes, a checkpoint of the other layout
    (the released [E, H, 2·I]) is swapped on load, as transformers does; else always swapped
    both ways. Then split as `inner` says."""

    def __init__(self, inner: Transform, dims: tuple[int, int], held: tuple[int, ...] | None = None) -> None:
        self.inner, self.dims, self.held, self.whole = inner, dims, held, inner.whole

    def _blocks(self, hf_shapes: Any, s: Shard, shapes: Shapes) -> Any:
        raise NotBlockwise("a transposed experts tensor is read whole")

    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> Any:
        t = hf[0][:]
        if self.held is None or tuple(t.shape) != self.held:
            t = t.transpose(*self.dims).contiguous()
        return self.inner.shard([t], s, shapes)

    def merge(self, shards: Sequence[Any], shapes: Shapes) -> tuple[Any, ...]:
        merged = self.inner.merge(shards, shapes)
        return merged if self.held is not None else tuple(t.transpose(*self.dims).contiguous() for t in merged)

    def __repr__(self) -> str:
        return f"TransposedExperts({self.inner!r}, {self.dims}, held={self.held})"


def transposed(converters: Iterable[Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int, bool]]:
    """{stacked experts tensor: (the dims its checkpoint tensor may swap, whether only where the
    shapes differ)}, for every tensor a lone `Transpose` converter (same name in the checkpoint
    and the model) applies to."""
    out: dict[str, tuple[int, int, bool]] = {}
    for conv in converters:
        ops = list(getattr(conv, "operations", ()))
        sources, targets = list(getattr(conv, "source_patterns", ())), list(getattr(conv, "target_patterns", ()))
        if len(ops) != 1 or type(ops[0]).__name__ != "Transpose" or sources != targets or len(sources) != 1:
            continue
        leaf = unescaped(sources[0])
        for name, shape in shapes.items():
            if name.endswith("." + leaf) and len(shape) == 3 and in_scope(conv, name):
                out[name] = (int(ops[0].dim0), int(ops[0].dim1), bool(getattr(ops[0], "check_dims", False)))
    return out


class ExpertSplit(NamedTuple):
    """How `moe_tp_experts` splits one stacked experts tensor [E, a, b] over TP: along its
    intermediate dim, dim 1 ("column") or dim 2 ("row"), in `packs` equal blocks each split on
    its own (a fused gate/up is 2, so `chunk(2)` still parts gate from up on every rank)."""

    split: str
    packs: int


# the stacked tensor's dim a split names (StackedExperts' pieces: their rows / columns)
SPLIT_DIMS = {"column": 1, "row": 2}
# (tp plan style, stacked tensor) under `moe_tp_experts` -> its split; the style alone does not
# say where the intermediate dim is (Inkling's `colwise` gate_up_proj [E, 2·I, H] would part
# gate from up), so an entry names both. transformers' in-memory layouts:
EXPERT_TP_SPLITS = {
    ("packed_colwise", "gate_up_proj"): ExpertSplit("column", 2),  # [E, 2·I, H]
    ("rowwise", "down_proj"): ExpertSplit("row", 1),  # [E, H, I]
    ("packed_rowwise", "gate_up_proj"): ExpertSplit("row", 2),  # [E, H, 2·I] (Llama 4, Aria)
    ("colwise", "down_proj"): ExpertSplit("column", 1),  # [E, I, H] (Llama 4, Aria)
    ("colwise", "up_proj"): ExpertSplit("column", 1),  # [E, I, H] (Nemotron-H's non-gated experts)
}


def expert_split(name: str, style: str | None) -> ExpertSplit | None:
    """The TP split of the stacked experts tensor `name` (a parameter or plan pattern) planned
    as `style`, or None where EXPERT_TP_SPLITS has no entry for it."""
    return EXPERT_TP_SPLITS.get((style or "", name.rpartition(".")[2]))


def unescaped(pattern: str) -> str:
    """A converter's name pattern as a name suffix: its escaped dots (`\\.experts`: Kimi-Linear's, DeepSeek-V4's)
    plain, its leading and trailing dots dropped."""
    return pattern.replace("\\.", ".").strip(".")


def in_scope(converter: Any, name: str) -> bool:
    """Whether `converter` reaches the model tensor `name`: transformers scopes a sub-model's
    converters to its module (`scope_prefix`, with or without the base model's prefix, as its
    `_scoped_match` does), so Dots3-Note's vision-tower expert converter (`fc1`/`fc3`) leaves the
    language model's experts (`gate_proj`/`up_proj`) to the language model's own."""
    scope = getattr(converter, "scope_prefix", None)
    if not scope:
        return True
    base = getattr(converter, "base_model_prefix", None)
    return name.startswith(f"{scope}.") or bool(base) and name.startswith(f"{base}.{scope}.")


def stack_converter(converter: Any) -> tuple[str, tuple[str, ...]] | None:
    """(target, sources) of a converter that stacks per-expert tensors, else None; patterns
    without their leading dots (`mlp.experts.gate_up_proj`, `mlp.experts.*.gate_proj.weight`)."""
    ops = tuple((type(o).__name__, getattr(o, "dim", None)) for o in getattr(converter, "operations", ()))
    targets, sources = list(converter.target_patterns), list(converter.source_patterns)
    if ops not in STACK_OPS or len(targets) != 1 or len(sources) != (1 if len(ops) == 1 else 2):
        return None
    if not all(s.count("*") == 1 for s in sources):
        return None
    return unescaped(targets[0]), tuple(unescaped(s) for s in sources)


def stacked(converters: Iterable[Any], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, ...]]:
    """{stacked tensor name: its per-expert checkpoint names, expert-major} (before the
    saving-direction renames), for every tensor a stacking converter produces."""
    out: dict[str, tuple[str, ...]] = {}
    for conv in converters:
        found = stack_converter(conv)
        if found is None:
            continue
        target, sources = found
        for name, shape in shapes.items():
            if name.endswith("." + target) and len(shape) == 3 and in_scope(conv, name):
                prefix = name[: -len(target)]
                out[name] = tuple(prefix + s.replace("*", str(e)) for e in range(shape[0]) for s in sources)
    return out


def _first_int(cfg: Any, keys: tuple[str, ...]) -> int | None:
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def expert_fields(cfg: Any) -> dict[str, int]:
    """The BridgeSpec MoE fields of a transformers config (none for a dense model): what the
    rules, megatron's process groups and the planner read; the MoE itself stays transformers'."""
    experts = _first_int(cfg, EXPERT_COUNT_KEYS)
    if not experts:
        return {}
    return {"num_moe_experts": experts, "moe_router_topk": _first_int(cfg, EXPERTS_PER_TOKEN_KEYS) or 1}


def expert_width(v: Any) -> int:
    """The planner's expert width from a config's: one number, or one per expert group (ERNIE-4.5-VL's text and
    vision experts, `moe_intermediate_size: [text, vision]`), of which it takes the widest."""
    return max(int(x) for x in v) if isinstance(v, (list, tuple)) else int(v)


def expert_limits(
    spec: Any, layout: Any, ep_plan: Iterable[tuple[str, str]], tp_plan: Iterable[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """What the transformers backend cannot run of a MoE model under `layout` (what, fix): EP splits
    the `ep_dispatch_experts` module of `base_model_ep_plan`; TP splits its experts as
    `moe_tp_experts` does (expert-TP = tp), each stacked tensor as EXPERT_TP_SPLITS says
    (by style and tensor, in either of transformers' layouts): another (style, tensor) on an
    experts tensor (Inkling's `colwise` gate_up_proj) is a split it does not know."""
    if not spec.is_moe:
        return []
    out = []
    tp_plan = tuple(tp_plan)
    moe = {p for p, s in tp_plan if s == MOE_TP}
    odd = [
        f"{p} {s!r}"
        for p, s in tp_plan
        if p.rpartition(".")[0] in moe and s != MOE_IDENTITY and expert_split(p, s) is None
    ]
    if layout.tp > 1 and odd:
        out.append(
            (
                f"tp={layout.tp}: {spec.architecture}'s experts split as {', '.join(odd)}; the transformers backend's "
                f"`{MOE_TP}` splits {', '.join(f'{t} {s!r}' for s, t in EXPERT_TP_SPLITS)} only",
                "set tp=1 (pp and dp run)",
            )
        )
    if layout.tp > 1 and layout.etp != layout.tp:
        out.append(
            (
                f"etp={layout.etp} with tp={layout.tp}: the transformers backend splits experts over the TP group "
                "(transformers' `moe_tp_experts`), so expert-TP is tp",
                f"set etp={layout.tp}",
            )
        )
    if layout.ep > 1:
        if not any(style == EP_MODULE for _, style in ep_plan):
            out.append(
                (
                    f"ep={layout.ep}: {spec.architecture} declares no `{EP_MODULE}` module in base_model_ep_plan",
                    "set ep=1",
                )
            )
        if spec.num_moe_experts % layout.ep:
            out.append(
                (f"{spec.num_moe_experts} experts do not split over ep={layout.ep}", "choose ep dividing the experts")
            )
    return out


__all__ = [
    "EXPERT_COUNT_KEYS",
    "EXPERTS_PER_TOKEN_KEYS",
    "EXPERT_TP_SPLITS",
    "ExpertSplit",
    "JoinedStackedExperts",
    "expert_fields",
    "expert_limits",
    "expert_width",
    "expert_split",
    "in_scope",
    "SPLIT_DIMS",
    "STACK_OPS",
    "StackedExperts",
    "WholeStackedExperts",
    "ep_part",
    "stack_converter",
    "stacked",
    "unescaped",
]
