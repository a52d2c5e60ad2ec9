"""Weight tables: which megatron parameter is made of which HF tensors, by which transform.

A family's table (`families/`) is a list of `Mapping`s. Each names a megatron parameter (a
template with `{layer}` / `{expert}` holes, global indices), the HF tensor(s) it is made of
and the `mapping.Transform` that lays them out. `resolve_megatron` / `resolve_hf` fill the
holes for concrete names, so one table serves online loading (`loader.py`), export and the
offline converter; the transforms themselves (shapes and tensors only) stay in `mapping.py` and
`stacked.py`, the shard coordinates and blocks they speak in `shards.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from megatron_bridge.bridge.mapping import REPLICATED, NotBlockwise, Transform
from megatron_bridge.bridge.shards import FULL, Shapes, Shard, Sliceable, out_shape

if TYPE_CHECKING:
    import torch

_HOLE = re.compile(r"\{(layer|expert)\}")


def _pattern(template: str) -> re.Pattern[str]:
    parts, pos = [], 0
    for m in _HOLE.finditer(template):
        parts.append(re.escape(template[pos : m.start()]))
        parts.append(f"(?P<{m.group(1)}>\\d+)")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(parts) + "$")


@dataclass(frozen=True, init=False)
class Mapping:
    """One table row: megatron parameter <- HF tensor(s) through a transform.

    `when` names a boolean attribute of the bridge spec (prefix `!` negates) that must hold
    for the row to apply (tied vs untied output layer, qkv bias, ...). `export=False` rows
    feed megatron on load but are not written back (the tied output layer, whose HF tensor
    is the embedding). A megatron name with `{expert}` is an expert weight: it is split over
    expert-parallel ranks by expert index and over the expert-TP group by the transform.
    """

    megatron: str
    hf: tuple[str, ...]
    transform: Transform = REPLICATED
    when: str | None = None
    export: bool = True
    _mpat: Any = field(default=None, compare=False, repr=False)
    _hpats: Any = field(default=None, compare=False, repr=False)

    def __init__(
        self,
        megatron: str,
        hf: str | Sequence[str],
        transform: Transform = REPLICATED,
        when: str | None = None,
        export: bool = True,
    ) -> None:
        # Written out (not the dataclass's) so that `hf` may be one name, stored as a 1-tuple.
        names = (hf,) if isinstance(hf, str) else tuple(hf)
        if len(names) != transform.n_hf:
            raise ValueError(f"{megatron}: {transform!r} takes {transform.n_hf} HF tensors, got {len(names)}")
        values = {"megatron": megatron, "hf": names, "transform": transform, "when": when, "export": export}
        values.update(_mpat=_pattern(megatron), _hpats=tuple(_pattern(h) for h in names))
        for name, value in values.items():
            object.__setattr__(self, name, value)

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.megatron

    def active(self, spec: Any) -> bool:
        if self.when is None:
            return True
        neg = self.when.startswith("!")
        value = bool(getattr(spec, self.when.lstrip("!")))
        return value != neg

    def match_megatron(self, name: str) -> dict[str, int] | None:
        m = self._mpat.match(name)
        return {k: int(v) for k, v in m.groupdict().items()} if m else None

    def match_hf(self, name: str) -> tuple[int, dict[str, int]] | None:
        """(which HF input, holes) if `name` is one of this row's HF tensors."""
        for i, p in enumerate(self._hpats):
            m = p.match(name)
            if m:
                return i, {k: int(v) for k, v in m.groupdict().items()}
        return None

    def megatron_name(self, **holes: int) -> str:
        return self.megatron.format(**holes)

    def hf_names(self, **holes: int) -> tuple[str, ...]:
        return tuple(h.format(**holes) for h in self.hf)

    # pure tensor API --------------------------------------------------------------------
    def shard(self, hf: Sequence[Sliceable], s: Shard, shapes: Shapes) -> torch.Tensor:
        return self.transform.shard(hf, s, shapes)

    def to_global(self, hf: Sequence[Sliceable], shapes: Shapes) -> torch.Tensor:
        return self.transform.shard(hf, FULL, shapes)

    def merge(self, shards: Sequence[torch.Tensor], shapes: Shapes) -> tuple[torch.Tensor, ...]:
        return self.transform.merge(shards, shapes)

    def shard_shape(self, hf_shapes: Sequence[tuple[int, ...]], s: Shard, shapes: Shapes) -> tuple[int, ...]:
        """The shape of shard `s` from the HF shapes alone: the transform's blocks, or, for a
        transform that is not blockwise (stacked experts, a 0-dim tensor) or whose blocks are
        bytes of a reshaped tensor (`Block.view`), its `shard` run on meta-device tensors (no
        memory). Raises ValueError where the shapes do not fit or split."""
        try:
            blocks = self.transform.blocks(hf_shapes, s, shapes)
            if not any(b.view for b in blocks):  # a view's blocks are bytes of a reshaped tensor
                return out_shape(blocks, hf_shapes)
        except NotBlockwise:
            pass
        import torch  # only for what the blocks cannot describe: the transformers backend's transforms, which has it

        meta = [torch.empty(tuple(x), device="meta") for x in hf_shapes]
        try:
            return tuple(self.transform.shard(meta, s, shapes).shape)
        except RuntimeError as e:  # torch's shape errors (cat, narrow) on shapes that do not fit
            raise ValueError(str(e).splitlines()[0]) from None


@dataclass(frozen=True)
class Resolved:
    """A table row with its holes filled: one megatron tensor and its HF tensors."""

    mapping: Mapping
    megatron: str  # global name (global layer and expert indices)
    hf: tuple[str, ...]
    holes: tuple[tuple[str, int], ...] = ()

    @property
    def layer(self) -> int | None:
        return dict(self.holes).get("layer")

    @property
    def expert(self) -> int | None:
        return dict(self.holes).get("expert")

    def select(self, hf: Sequence[Sliceable]) -> list[Sliceable]:
        """The transform's inputs from the HF tensors: for a row whose HF tensors stack
        every expert (`Transform.stacked`), this expert's slab [e:e+1] (a LazySlice reads
        only those bytes); otherwise the tensors themselves."""
        if not self.mapping.transform.stacked:
            return list(hf)
        e = self.expert
        assert e is not None
        return [t[e : e + 1] for t in hf]

    def select_shapes(self, shapes: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The shapes of `select`'s result, from the HF tensors' shapes (for `Transform.blocks`)."""
        if not self.mapping.transform.stacked:
            return [tuple(x) for x in shapes]
        return [(1, *x[1:]) for x in shapes]


def resolve_megatron(table: Sequence[Mapping], name: str) -> Resolved | None:
    """The row producing global megatron parameter `name` (first match wins)."""
    for m in table:
        holes = m.match_megatron(name)
        if holes is not None:
            return Resolved(m, name, m.hf_names(**holes), tuple(sorted(holes.items())))
    return None


def resolve_hf(
    table: Sequence[Mapping], hf_keys: Iterable[str], num_experts: int | None = None
) -> tuple[list[Resolved], list[str]]:
    """Group a checkpoint's HF tensor names into table rows.

    Returns (rows whose HF inputs are all present, HF names no row consumes). A row with
    only some inputs present is an error: the checkpoint is inconsistent with the table.
    A stacked-experts row (HF name without `{expert}`) gives one row per expert
    (`num_experts` of them), each reading its slab of the same HF tensor.
    """
    keys = list(hf_keys)
    present = set(keys)
    out: dict[tuple[int, str], Resolved] = {}
    used = set()
    for key in keys:
        for ti, m in enumerate(table):
            hit = m.match_hf(key)
            if hit is None:
                continue
            _, holes = hit
            names = m.hf_names(**holes)
            missing = [n for n in names if n not in present]
            if missing:
                raise KeyError(f"{key} maps to {m.megatron} which also needs {missing}, absent from the checkpoint")
            used.add(key)
            each = [holes]
            if m.is_expert and "expert" not in holes:
                if not m.transform.stacked or not num_experts:
                    raise ValueError(
                        f"{m.megatron}: expert row without {{expert}} in its HF names needs stacked experts"
                    )
                each = [{**holes, "expert": e} for e in range(num_experts)]
            for h in each:
                mname = m.megatron_name(**h)
                out.setdefault((ti, mname), Resolved(m, mname, names, tuple(sorted(h.items()))))
    order = {id(m): i for i, m in enumerate(table)}
    resolved = sorted(
        out.values(), key=lambda r: (r.layer if r.layer is not None else -1, order[id(r.mapping)], r.expert or 0)
    )
    return resolved, [k for k in keys if k not in used]


__all__ = ["Mapping", "Resolved", "resolve_megatron", "resolve_hf"]
