"""Which table rows a checkpoint fills, checked against its config before anything is written.

A conversion works row by row: one row of the family's table (`bridge.table.Mapping`) is
one megatron parameter and the HF tensor(s) it is made of. `resolve_rows` groups a
checkpoint's tensor names into rows with the bridge's own `resolve_checkpoint` (unknown
tensors are an error there) and then checks what only a whole-checkpoint view can:

* completeness: every tensor the config implies is present (the backend's `expected`), and
  no tensor lies beyond the config (a layer index >= num_hidden_layers, an expert >= E);
* shapes: each row's HF shapes go through the row's own transform (`Mapping.shard_shape`: its
  blocks, shapes only, so the transform's checks run — QKV head geometry, vocab rows,
  divisibility — without torch; meta-device tensors for a transform that is not blockwise) and
  the resulting tensor must have the shape the backend's model gives it for this config; all
  inputs of a row share one dtype (a mixed QKV would be upcast).

`check_layout_shards` asks the same transforms for rank 0's shard under a layout, which
catches sizes that do not split over tp (e.g. an FFN width not divisible by tp) with the
tensor's name. Dtypes are only compared and printed: torch dtypes or `convert.formats.dtypes.DType`s.
"""

from __future__ import annotations

from collections.abc import Mapping as TMapping
from collections.abc import Sequence
from typing import Any

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.loader import resolve_checkpoint, shard_for, table_for
from megatron_bridge.bridge.shards import FULL
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.errors import UserError

Shape = tuple[int, ...]
Tensors = TMapping[str, tuple[Shape, Any]]  # HF name -> (shape, dtype)


def resolve_rows(spec: BridgeSpec, tensors: Tensors, tp: int = 1, where: str = "the checkpoint") -> list[Resolved]:
    """Rows of `tensors` ({HF name: (shape, dtype)}), validated against the spec (see module doc)."""
    try:
        rows = resolve_checkpoint(spec, list(tensors))
    except KeyError as e:
        raise UserError(f"{where} is incomplete: {e.args[0]}") from None
    shapes = spec.shapes(tp)
    want = backend_of(spec).expected(spec, shapes.padded_vocab_size)
    have = {r.megatron for r in rows}
    table = table_for(spec)
    missing = [n for n in want if n not in have]
    if missing:
        found = [resolve_megatron(table, n) for n in missing[:6]]  # `want` comes from the table
        hf = [h for r in found if r is not None for h in r.hf]
        raise UserError(
            f"{where} lacks {len(missing)} tensor(s) the {spec.architecture} config needs, e.g. "
            f"{', '.join(dict.fromkeys(hf))}{' ...' if len(missing) > 6 else ''}"
        )
    beyond = [r for r in rows if r.megatron not in want]
    if beyond:
        raise UserError(
            f"{where} has tensors the config does not describe (num_hidden_layers={spec.num_layers}"
            f"{f', experts={spec.num_moe_experts}' if spec.is_moe else ''}): "
            f"{', '.join(h for r in beyond[:4] for h in r.hf)}{' ...' if len(beyond) > 4 else ''}"
        )
    bad: list[str] = []
    for r in rows:
        dtypes = {tensors[h][1] for h in r.hf}
        if len(dtypes) > 1:
            bad.append(f"{', '.join(r.hf)} mix dtypes {sorted(map(str, dtypes))}")
            continue
        hf_shapes = r.select_shapes([tensors[h][0] for h in r.hf])
        stacked = [tuple(tensors[h][0]) for h in r.hf if r.mapping.transform.stacked]
        if any(x[:1] != (spec.num_moe_experts,) for x in stacked):
            bad.append(f"{', '.join(r.hf)} {[list(x) for x in stacked]}: not {spec.num_moe_experts} stacked experts")
            continue
        try:
            g = r.mapping.shard_shape(hf_shapes, FULL, shapes)
        except ValueError as e:
            bad.append(f"{', '.join(r.hf)} {[list(x) for x in hf_shapes]}: {e}")
            continue
        expected = want[r.megatron]
        if expected is not None and g != expected:
            bad.append(
                f"{', '.join(r.hf)} {[list(x) for x in hf_shapes]}: {r.megatron} would be "
                f"{list(g)}, the config implies {list(expected)}"
            )
    if bad:
        raise UserError(
            f"{where}: {len(bad)} tensor shape(s) disagree with config.json "
            f"(hidden_size={spec.hidden_size}, heads={spec.num_attention_heads}/{spec.num_query_groups}, "
            f"head_dim={spec.head_dim}, intermediate={spec.ffn_hidden_size}, vocab={spec.vocab_size}):\n"
            + "\n".join(f"  - {b}" for b in bad[:8])
        )
    return rows


def check_layout_shards(spec: BridgeSpec, layout: Layout, rows: Sequence[Resolved], tensors: Tensors) -> None:
    """Every row must split over the layout (rank 0's shard, from shapes: nothing is read)."""
    shapes = spec.shapes(layout.tp)
    bad = []
    for r in rows:
        try:
            hf_shapes = r.select_shapes([tensors[h][0] for h in r.hf])
            r.mapping.shard_shape(hf_shapes, shard_for(r, layout, Coords()), shapes)
        except ValueError as e:
            bad.append(f"{r.megatron}: {e}")
    if bad:
        raise UserError(
            f"the layout {layout.describe()} cannot split this model:\n" + "\n".join(f"  - {b}" for b in bad[:8])
        )


def producers(rows: Sequence[Resolved]) -> dict[tuple[str, ...], Resolved]:
    """HF names -> the exported row that stores them (the tied output layer reads the
    embedding's HF tensor but is never stored itself)."""
    return {r.hf: r for r in rows if r.mapping.export}


__all__ = ["resolve_rows", "check_layout_shards", "producers"]
