"""Where a conversion writes to: torch_dist, per-rank torch files, or an HF directory.

Each writer pulls rows from a `Source` (HF tensors of one table row at a time) and turns
them into its layout with the row's own transform — on the source's read-ahead thread
(`Source.stream`), while this thread writes the previous row — so peak memory is one row's
tensors plus what is derived from them (about twice the largest tensor) plus the bounded
read-ahead:

* `DistOut`: `Mapping.to_global` -> one chunk per layer/expert (`dist_ckpt`).
* `TorchOut`: per pipeline stage, the stage's rank files are open together and each row is
  read once and split with the bridge's `shard_of` into every rank that holds it (dense
  rows are written to every EP rank's file, as Megatron does); the stored `args`,
  `checkpoint_version` and what the backend's chunk state dict holds besides (the native
  backend's `_extra_state` entries) complete each file.

Where a tensor is stored and what a rank file holds are the backend's (`Backend.dist_location`,
`owned`, `rank_state`, `checkpoint_args`); nothing here knows a backend's names.
* `HFOut`: the HF tensors as they come, into size-capped safetensors files planned up front
  (names, shapes and dtypes are known from the source before any data is read).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.loader import shard_for, shard_of
from megatron_bridge.bridge.mapping import NotBlockwise
from megatron_bridge.bridge.shards import FULL
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.bytemove.direct import DirectCopy
from megatron_bridge.convert.bytemove.direct_export import DirectExport
from megatron_bridge.convert.bytemove.direct_reshard import DirectReshard
from megatron_bridge.convert.bytemove.pool import resolve_workers
from megatron_bridge.convert.formats.dist_ckpt import DistWriter
from megatron_bridge.convert.formats.dtypes import DType
from megatron_bridge.convert.formats.manifest import INDEX_CRC32, list_crc32
from megatron_bridge.convert.formats.safetensors_io import INDEX, SafetensorsWriter, plan_shards
from megatron_bridge.convert.formats.torch_zip import StreamingTorchSave, TensorRef
from megatron_bridge.convert.pipeline.dst import EXPORT_MARK
from megatron_bridge.convert.pipeline.writeback import Writeback
from megatron_bridge.convert.placement.rank_files import (
    RELEASE,
    TRACKER,
    RankFile,
    chunk_key,
    common_state,
    stage_coords,
    stage_targets,
)
from megatron_bridge.convert.sources.readers import DistSource, HFSource, Source, TorchSource

if TYPE_CHECKING:  # torch is imported where it is used: the byte paths never import it
    import torch

Advance = Callable[[int, int], None]  # (tensors, bytes)


# The byte engine for each kind of source (convert, reshard); each yields None where it
# cannot copy bytes (a cast, ...) and the writer then goes through tensors.
BYTE_PATHS = {HFSource: DirectCopy.open, TorchSource: DirectReshard.open, DistSource: DirectReshard.open}


def byte_path(
    source: Source, workers: int, layout: Layout | None = None
):  # -> ctx of DirectCopy | DirectReshard | None
    opener = next((o for kind, o in BYTE_PATHS.items() if isinstance(source, kind)), None)
    return opener(source, workers) if opener is not None and blockwise(source, layout) else nullcontext()


def blockwise(source: Source, layout: Layout | None = None) -> bool:
    """Whether every row is byte ranges of its HF tensors (its transform's blocks: not stacked
    experts built from per-expert tensors, not a 0-dim tensor, not a reshaped view) and, under `layout`, a rank's
    tensor is one TP shard of it (not a run of stacked experts, in the output's layout or a
    per-rank source's) — what the byte engines copy."""
    if not source.byte_paths:
        return False
    backend, shapes = backend_of(source.spec), source.spec.shapes(1)
    ep = max(layout.ep if layout else 1, getattr(getattr(source, "layout", None), "ep", 1))  # either side's
    for r in source.rows:
        if ep > 1 and backend.ep_stacked(source.spec, r):
            return False
        try:
            blocks = r.mapping.transform.blocks(r.select_shapes([source.tensors[h][0] for h in r.hf]), FULL, shapes)
        except NotBlockwise:
            return False
        except ValueError:
            continue  # shapes that do not fit: refused by the source's own checks
        if any(b.view for b in blocks):  # bytes of a reshaped tensor: the stored shape is not the blocks'
            return False
    return True


def main_dtype(source: Source) -> DType:
    """The dtype holding most bytes (Megatron's `params_dtype` in the stored args)."""
    sizes: dict[DType, int] = {}
    for name, (shape, _) in source.tensors.items():
        d = source.out_dtype(name)
        sizes[d] = sizes.get(d, 0) + prod(shape) * d.itemsize
    return max(sizes, key=sizes.__getitem__)


def compact(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and owning exactly its bytes (a file record stores the whole storage)."""
    t = t.detach().contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _exported(source: Source) -> list[Resolved]:
    return [r for r in source.rows if r.mapping.export]


class DistOut:
    format = "torch_dist"

    def __init__(self, spec: BridgeSpec, layout: Layout, workers: int = 0):
        self.spec, self.layout, self.workers = spec, layout, workers  # workers: the byte path's pool
        self.backend = backend_of(spec)

    def total(self, source: Source) -> tuple[int, int]:
        rows = _exported(source)
        return sum(source.count(r) for r in rows), sum(source.nbytes(r) for r in rows)

    def _tensors(self, source: Source, w: DistWriter) -> Iterator[tuple[Resolved, int]]:
        shapes = self.spec.shapes(self.layout.tp)

        def to_global(row: Resolved, hf: list[torch.Tensor]) -> torch.Tensor:  # runs on the read-ahead thread
            return compact(row.mapping.to_global(row.select(hf), shapes))

        for row, g in source.stream(_exported(source), to_global):

            def fill(item: StreamingTorchSave, shape: tuple[int, ...], g: torch.Tensor = g) -> TensorRef:
                return item.add(g.reshape(shape))

            w.add(self.backend.dist_location(self.spec, row.megatron), g.dtype, tuple(g.shape), fill)
            yield row, g.nbytes
            del g

    def _direct(self, direct: DirectCopy | DirectReshard, w: DistWriter) -> Iterator[tuple[Resolved, int]]:
        shapes = self.spec.shapes(self.layout.tp)
        for row in _exported(direct.source):
            dtype, shape = direct.shard_info(row, FULL, shapes)

            def fill(item: StreamingTorchSave, shape: tuple[int, ...], row: Resolved = row) -> TensorRef:
                return direct.write(row, FULL, shapes, item, shape)[0]

            w.add(self.backend.dist_location(self.spec, row.megatron), dtype, shape, fill)
            yield row, prod(shape) * dtype.itemsize

    def write(self, root: Path, source: Source, advance: Advance) -> None:
        w = DistWriter(root / RELEASE, self.total(source)[1])
        with (
            byte_path(source, self.workers, self.layout) as direct,
            Writeback() as wb,
        ):
            for row, nbytes in self._direct(direct, w) if direct else self._tensors(source, w):
                extra = self.backend.dist_extra_state(self.spec, row.megatron)
                if extra is not None:
                    w.add_object(extra)
                advance(source.count(row), source.nbytes(row))
                wb.wrote(w.paths, nbytes)
            if direct:
                direct.drain()
        w.finish(common_state(self.backend.checkpoint_args(self.spec, self.layout, main_dtype(source), self.format)))
        (root / TRACKER).write_text("release")


class TorchOut:
    format = "torch"

    def __init__(self, spec: BridgeSpec, layout: Layout, workers: int = 0):
        self.spec, self.layout, self.workers = spec, layout, workers  # workers: the byte path's pool
        self.backend = backend_of(spec)
        self._plan: list[tuple[int, dict]] | None = None

    def _stages(self, source: Source) -> list[tuple[int, dict]]:
        if self._plan is None:
            self._plan = [(pp, stage_targets(self.spec, self.layout, source.rows, pp)) for pp in range(self.layout.pp)]
        return self._plan

    def total(self, source: Source) -> tuple[int, int]:
        n = b = 0
        for _, targets in self._stages(source):
            rows = [r for r in source.rows if r.megatron in targets]
            n += sum(source.count(r) for r in rows)
            b += sum(source.nbytes(r) for r in rows)
        return n, b

    def _tensors(self, source: Source, rows: list[Resolved], targets: dict, files: dict) -> Iterator[tuple]:
        def split(row: Resolved, hf: list[torch.Tensor]) -> list[tuple[object, torch.Tensor]]:
            # a dense row: one shard per tp rank, written to every EP rank's file; a tensor that
            # stacks every expert: one per (tp, ep) rank
            done: dict[tuple[object, int], torch.Tensor] = {}
            ep_run = self.backend.ep_stacked(self.spec, row)
            out = []
            for t in targets[row.megatron]:
                key = (shard_for(row, self.layout, t.coords), t.coords.ep_rank if ep_run else 0)
                if key not in done:
                    done[key] = compact(shard_of(row, hf, self.spec, self.layout, t.coords))
                out.append((t, done[key]))
            return out

        for row, shards in source.stream(rows, split):
            yield row, [(t, files[t.file].add(x), x.nbytes) for t, x in shards]
            del shards

    def _direct(
        self, direct: DirectCopy | DirectReshard, rows: list[Resolved], targets: dict, files: dict
    ) -> Iterator[tuple]:
        shapes = self.spec.shapes(self.layout.tp)
        for row in rows:
            out = []
            for t in targets[row.megatron]:
                ref, nbytes = direct.write(row, shard_for(row, self.layout, t.coords), shapes, files[t.file])
                out.append((t, ref, nbytes))
            yield row, out

    def write(self, root: Path, source: Source, advance: Advance) -> None:
        args = self.backend.checkpoint_args(self.spec, self.layout, main_dtype(source), self.format)
        with byte_path(source, self.workers, self.layout) as direct:
            for pp, targets in self._stages(source):
                files: dict[RankFile, StreamingTorchSave] = {}
                chunks: dict[RankFile, dict[str, dict[str, tuple[int, object]]]] = {}
                for c in stage_coords(self.layout, pp):  # every file and chunk exists, even if empty
                    f = RankFile(c.tp_rank, pp, c.ep_rank)
                    if f not in files:
                        files[f] = StreamingTorchSave(root / f.relpath(self.layout))
                    chunks.setdefault(f, {})[chunk_key(self.layout, c.vp_stage)] = {}
                rows = [r for r in source.rows if r.megatron in targets]
                made = (
                    self._direct(direct, rows, targets, files)
                    if direct
                    else self._tensors(source, rows, targets, files)
                )
                with Writeback() as wb:
                    for row, shards in made:
                        for t, ref, _ in shards:
                            chunks[t.file][t.chunk][t.local] = (source.order[row.megatron], ref)
                        advance(source.count(row), source.nbytes(row))
                        wb.wrote({files[t.file].path for t, _, _ in shards}, sum(n for _, _, n in shards))
                if direct:
                    direct.drain()
                for f, w in files.items():
                    obj: dict[str, object] = dict(common_state(args))
                    for ck, entries in chunks[f].items():
                        vp = None if ck == "model" else int(ck[len("model") :])
                        post = Coords(pp_rank=pp, vp_stage=vp).post_process(self.layout)
                        obj[ck] = self.backend.rank_state(self.spec, entries, post)
                    w.finish(obj)
        (root / TRACKER).write_text("release")


class _ShardFiles:
    """The planned safetensors files of an export, opened in turn as their tensors come."""

    def __init__(
        self,
        root: Path,
        names: list[str],
        files: list[list[tuple]],
        where: dict[str, int],
        wb: Writeback,
        before_close: Callable[[], None] = lambda: None,
    ):
        self.root, self.names, self.files, self.where, self.wb = root, names, files, where, wb
        self.before_close = before_close  # lets queued writes into the current file finish
        self.index = -1
        self.current: SafetensorsWriter | None = None

    def writer(self, name: str) -> SafetensorsWriter:
        if self.where[name] != self.index:
            self.close()
            self.index = self.where[name]
            self.current = SafetensorsWriter(self.root / self.names[self.index], self.files[self.index])
        assert self.current is not None  # opened above, or by the previous call for the same file
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.before_close()
            self.current.close()
            self.wb.forget(self.current.path)
            self.current = None


class HFOut:
    format = "hf"

    def __init__(self, max_shard_bytes: int, workers: int = 0):
        self.max_shard_bytes, self.workers = max_shard_bytes, workers  # workers: the byte path's pool

    def total(self, source: Source) -> tuple[int, int]:
        rows = _exported(source)
        return sum(source.count(r) for r in rows), sum(source.nbytes(r) for r in rows)

    def write(self, root: Path, source: Source, advance: Advance) -> None:
        names_in_order = dict.fromkeys(h for r in _exported(source) for h in r.hf)  # stacked experts: once
        entries = [(h, source.out_dtype(h), source.tensors[h][0]) for h in names_in_order]
        files = plan_shards(entries, self.max_shard_bytes)
        n = len(files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        where = {e[0]: i for i, group in enumerate(files) for e in group}
        with (
            DirectExport.open(source, self.workers) if blockwise(source) else nullcontext() as direct,
            Writeback() as wb,
        ):
            out = _ShardFiles(root, names, files, where, wb, direct.drain if direct else lambda: None)
            if direct is not None:
                for row in _exported(source):
                    for name in row.hf if source.count(row) else ():  # a stacked tensor with its expert 0
                        w = out.writer(name)
                        wb.wrote((w.path,), direct.write(name, *w.reserve(name), w.path))
                    advance(source.count(row), source.nbytes(row))
            else:
                for row, hf in source.stream(_exported(source)):
                    for name, t in zip(row.hf, hf) if source.count(row) else ():  # stacked: with expert 0
                        w = out.writer(name)
                        w.write(name, t)
                        wb.wrote((w.path,), t.nbytes)
                    advance(source.count(row), source.nbytes(row))
                    del hf
            out.close()
        total = sum(prod(e[2]) * e[1].itemsize for e in entries)
        weight_map = {e[0]: names[where[e[0]]] for e in sorted(entries)}
        crcs = list_crc32(root, names, resolve_workers(self.workers))  # read back (cached): what a later load checks
        meta = {"total_size": total, "written_by": EXPORT_MARK, INDEX_CRC32: crcs}
        (root / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": weight_map}, indent=2) + "\n")


__all__ = ["DistOut", "TorchOut", "HFOut"]
