"""The model a Megatron-written checkpoint holds, as `model.hf_path` describes it and the checkpoint confirms.

`describe_source` gives the native description of `model.hf_path`'s config.json, padded as the
stored embedding says (the recorded `make_vocab_size_divisible_by` at the recorded TP degree),
after every fact the run recorded is checked against it (`megatron_model.check_facts`);
`hf_rows` turns the stored megatron tensors' shapes into the HF tensor table and validated rows
the readers work on; `synthetic_manifest` is what the commands read where a converted
checkpoint has its manifest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_bridge.backends.describe import describe_hf
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.layout import Layout
from megatron_bridge.bridge.loader import hf_assets, table_for
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.manifest import Manifest
from megatron_bridge.convert.placement.manifest_model import layout_record
from megatron_bridge.convert.sources.megatron import MegatronDir
from megatron_bridge.convert.sources.megatron_derive import derive_hf_config
from megatron_bridge.convert.sources.megatron_model import RunRecord, check_facts, run_record
from megatron_bridge.convert.sources.readers import TensorTable
from megatron_bridge.convert.sources.rows import resolve_rows
from megatron_bridge.errors import UserError


def _padded(vocab: int, divisor: int, tp: int) -> int:
    step = divisor * tp
    return math.ceil(vocab / step) * step


def _divisor(hf: dict[str, Any], record: RunRecord, rows: int, default: int, where: str, by: str) -> int:
    """The `make_vocab_size_divisible_by` that pads config.json's vocabulary to the stored
    embedding's `rows` at the run's TP degree: the recorded one (checked), else `default`
    (`model.make_vocab_size_divisible_by`), else the smallest power of two that does."""
    vocab, tp = int(hf.get("vocab_size") or 0), record.tp
    if rows < vocab:
        raise UserError(
            f"{where} holds an embedding of {rows} rows, fewer than the vocabulary of {vocab} that {by} "
            "describes: another model's config (point model.hf_path at the config of the model this "
            "checkpoint trained)"
        )
    if record.divisor is not None:
        if _padded(vocab, record.divisor, tp) != rows:
            raise UserError(
                f"{where} holds another model than {by} describes; point model.hf_path at the HF config of "
                f"the model this checkpoint trained:\n  - vocab padding: {by} says vocab_size={vocab}, which the "
                f"run's make_vocab_size_divisible_by={record.divisor} at tp{tp} pads to "
                f"{_padded(vocab, record.divisor, tp)} rows; the checkpoint's embedding has {rows}"
            )
        return record.divisor
    if _padded(vocab, default, tp) == rows:
        return default
    for d in (2**k for k in range(0, 20)):
        if _padded(vocab, d, tp) == rows:
            return d
    raise UserError(
        f"{where}: an embedding of {rows} rows is not the vocabulary of {vocab} ({by}) padded to a "
        "multiple of any power of two; point model.hf_path at the config of the model this checkpoint trained"
    )


def _merged_shapes(row: Resolved, shape: tuple[int, ...], shapes: Any) -> list[tuple[int, ...]]:
    """The HF tensors' shapes of `row` whose megatron tensor is `shape` (meta tensors: no data)."""
    import torch

    out = row.mapping.merge([torch.empty(shape, device="meta")], shapes)
    return [tuple(t.shape) for t in out]


@dataclass(frozen=True)
class Described:
    """What `describe_source` found: the model, where its config and tokenizer are (None: not a
    file), the layout the run wrote, and the checkpoint it describes."""

    spec: BridgeSpec
    hf: dict[str, Any]
    config_file: Path | None
    layout: Layout
    md: MegatronDir


def describe_source(
    md: MegatronDir,
    state: dict[str, Any],
    hf_path: str | Path | None,
    default_divisor: int,
    rows: int,
    arg: str,
    hf: dict[str, Any] | None = None,
) -> Described:
    """The description of `md`'s model: `hf_path`'s config.json (or the run's model's, `hf`;
    neither: the one its run's record gives, `megatron_derive`) padded as the embedding's `rows`
    say, every fact the run recorded checked against it (one error naming each mismatch)."""
    where = str(md.given)
    record = run_record(md, state)
    config_file = None
    if hf is None and not hf_path:
        hf, note = derive_hf_config(record, rows)
        if hf is None:
            raise UserError(
                f"{where} is a {md.describe()}, and {note}: the HF model it holds cannot be derived from what "
                f"its run recorded. Set {arg}=DIR (the HF directory of the model it trained, or just its "
                "config.json; the tokenizer files beside it are copied into an export)"
            )
        by = "the config its run's record gives"
        print(
            f"note: no {arg}: {where} is described as the {hf['architectures'][0]} its run recorded"
            + (f"; {note}" if note else "")
            + f"; an export carries no tokenizer files ({arg}=DIR names the model and copies them)",
            flush=True,
        )
    elif hf is None:
        assert hf_path is not None
        by = f"{arg}={hf_path}"
        hf = read_hf_config(hf_path, arg=arg)
        config_file = Path(hf_path) / "config.json" if Path(hf_path).is_dir() else Path(hf_path)
    else:
        by = "the run's model"
    divisor = _divisor(hf, record, rows, default_divisor, where, by)
    # the native backend's: a megatron-core GPTModel's parameters are what these checkpoints hold
    spec = describe_hf(hf, make_vocab_size_divisible_by=divisor, backend="native")
    for kind, fields in record.records:
        check_facts(spec, fields, kind, where, by)
    return Described(spec, hf, config_file, record.layout(spec), md)


def synthetic_manifest(d: Described) -> Manifest:
    """The `Manifest` the export and reshard commands read (model, layout, assets, no checksums)."""
    return Manifest(
        format=d.md.format,
        hf_config=d.hf,
        layout=layout_record(d.layout),
        dtype="mixed",
        make_vocab_size_divisible_by=d.spec.make_vocab_size_divisible_by,
        tensors={},
        assets=hf_assets(d.config_file.parent, skip=("config.json",)) if d.config_file else [],
        source=str(d.md.given),
        created_by=d.md.writer,
        backend="native",
    )


def hf_rows(spec: BridgeSpec, tp: int, shapes_of: dict[str, tuple[tuple[int, ...], DType]], where: str):
    """The HF tensor table and validated rows of megatron parameters {name: (global shape, dtype)}."""
    table, shapes = table_for(spec), spec.shapes(tp)
    tensors: TensorTable = {}
    for name, (shape, dtype) in shapes_of.items():
        row = resolve_megatron(table, name)
        if row is None or not row.mapping.export:
            continue
        for h, s in zip(row.hf, _merged_shapes(row, shape, shapes)):
            if row.mapping.transform.stacked:  # every expert's slab of one HF tensor
                s = (tensors[h][0][0] + 1, *s[1:]) if h in tensors else s
            elif row.mapping.transform.piece is not None:  # every piece's rows of one HF tensor
                s = (tensors[h][0][0] + s[0], *s[1:]) if h in tensors else s
            tensors[h] = (s, dtype)
    return tensors, resolve_rows(spec, tensors, tp=tp, where=where)


__all__ = ["Described", "describe_source", "hf_rows", "synthetic_manifest"]
