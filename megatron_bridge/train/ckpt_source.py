"""A training checkpoint (`checkpoint.dir`) read as one model: what `mbr export` and `mbr reshard` read.

Each rank's file holds its chunks' state dicts and its optimizer's state per parameter name
(train/optim_state.py); the manifest holds the layout it was written at (`grid`). From those the
checkpoint is put back together row by row of the backend's table, as a converted per-rank
checkpoint is (convert/sources/readers.py): a row's TP shards come from the ranks that hold it
(one replica each: the lowest rank), joined over EP where its tensor stacks every expert, and are
merged by the row's own transform into HF tensors. An optimizer state tensor is put together the
same way, after each shard is assembled from the flat ranges its data-parallel replicas hold (the
distributed optimizer's shares; a plain optimizer's replicas each hold all of it).

`TrainingSource` is that as a conversion `Source` of the model's weights (`mbr export`, `mbr
reshard format=torch|torch_dist`); train/reshard.py writes another layout's training checkpoint
from it, optimizer state included. Files are memory-mapped: a tensor's bytes are read when a row
needs them. The checkpoint is verified first (sizes, sha256, pickles naming only data).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.layout import Coords, Layout
from megatron_bridge.bridge.loader import shard_for, table_for
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved, resolve_megatron
from megatron_bridge.convert.formats.dtypes import dtype_of
from megatron_bridge.convert.formats.pickle_guard import TRAINING
from megatron_bridge.convert.sources.readers import Source
from megatron_bridge.errors import UserError
from megatron_bridge.parallel.topology import Topology
from megatron_bridge.runtime.safe_load import torch_load
from megatron_bridge.train.manifest import LATEST, iter_dir, latest_iteration, verify

Holder = tuple[int, int, str, Coords]  # (rank, chunk index, the tensor's name there, its coordinates)


def checkpoint_dir(path: Path) -> Path:
    """The iteration directory `path` means: `latest`'s in a checkpoint.dir, or an iter_N itself."""
    if (path / LATEST).is_file():
        it = latest_iteration(path)
        assert it is not None
        return iter_dir(path, it)
    return path


class TrainingCheckpoint:
    """The rank files of one training checkpoint, the layout they were written at, and where each
    row's tensor is (see the module doc)."""

    def __init__(self, path: Path, spec: BridgeSpec, model: str):
        self.dir = checkpoint_dir(path)
        self.spec, self.where = spec, f"src={path}"
        man = verify(self.dir)  # sizes, sha256 and pickles, before anything is loaded
        if man.get("engine") != "megatron":
            raise UserError(
                f"{self.where} was trained with the {man.get('engine')} engine, whose model and optimizer state "
                "live in its own files: resharding reads megatron-engine checkpoints (train.engine=megatron)"
            )
        if "peft" in man:
            raise UserError(
                f"{self.where} is a LoRA run's checkpoint (adapters only, {man['peft']}): export its adapter "
                "with `mbr export src=DIR dst=OUT adapter=true`; resharding reads full-model checkpoints"
            )
        if "grid" not in man:
            raise UserError(
                f"{self.where} was written by an mbr that did not record its layout's grid: resume it once with "
                "this mbr (checkpoint.resume=true) and let it save, then export or reshard that checkpoint"
            )
        if man.get("model") != model:
            raise UserError(
                f"{self.where} holds {man.get('model')}, but the model given is {model}: name the model it was "
                "trained with (model.hf_path=DIR, or the recipe's model group)"
            )
        self.manifest, self.iteration = man, int(man["iteration"])
        grid = man["grid"]
        self.layout = Layout(**grid, gpus_per_node=grid["world_size"])
        self.coords = Topology(self.layout).coords
        self.states = [
            torch_load(self.dir / f"rank_{r:05d}.pt", TRAINING, map_location="cpu", mmap=True)
            for r in range(int(man["world_size"]))
        ]
        names = backend_of(spec).expected(spec, spec.padded_vocab_size(self.layout.tp))
        table = table_for(spec)
        self.rows = [r for n in names if (r := resolve_megatron(table, n)) is not None]
        self._alias: dict[str, str] = {}  # a row read as another's (the tied output layer as the embedding)
        self._holders = {r.megatron: list(self._find(r)) for r in self.rows}
        producer = {r.hf: r for r in self.rows if r.mapping.export}
        for (
            r
        ) in self.rows:  # a tied output layer no chunk holds (its embedding's chunk is also the last): the embedding's
            if not r.mapping.export and not self._holders[r.megatron]:
                self._holders[r.megatron] = self._holders[producer[r.hf].megatron]
                self._alias[r.megatron] = producer[r.hf].megatron
        missing = [r.megatron for r in self.rows if not self._holders[r.megatron]]
        if missing:
            raise UserError(f"{self.where}: no rank holds {', '.join(missing[:4])} (not this model's checkpoint)")

    def rank_coords(self, rank: int, vp: int | None) -> Coords:
        c = self.coords
        return Coords(int(c["tp"][rank]), int(c["pp"][rank]), int(c["ep"][rank]), int(c["etp"][rank]), vp)

    def _find(self, row: Resolved) -> Iterator[Holder]:
        backend, lay = backend_of(self.spec), self.layout
        for rank in range(len(self.states)):
            for i in range(len(self.states[rank]["engine"]["model"])):
                vp = i if lay.vpp else None
                c = self.rank_coords(rank, vp)
                local = backend.owned(self.spec, row, lay, c, lay.stage_layers(self.spec.num_layers, c.pp_rank, vp))
                if local is not None:
                    yield rank, i, local, c

    def _replicas(self, row: Resolved) -> list[list[list[Holder]]]:
        """The ranks holding each piece of `row`: [TP shard][EP run, joined on dim 0][replicas]."""
        ep_run = self.layout.ep > 1 and backend_of(self.spec).ep_stacked(self.spec, row)
        pieces: dict[tuple[int, int], list[Holder]] = {}
        for h in self._holders[row.megatron]:
            s = shard_for(row, self.layout, h[3])
            pieces.setdefault((s.rank, h[3].ep_rank if ep_run else 0), []).append(h)
        shards: dict[int, list[list[Holder]]] = {}
        for (tp, _), hs in sorted(pieces.items()):
            shards.setdefault(tp, []).append(hs)
        out = list(shards.values())
        return out[:1] if row.mapping.transform.whole else out

    def weight_shards(self, row: Resolved) -> list[torch.Tensor]:
        """`row`'s tensor on each TP shard (one replica's)."""
        return [_join([self._model(run[0]) for run in shard]) for shard in self._replicas(row)]

    def _model(self, h: Holder) -> torch.Tensor:
        rank, i, local, _ = h
        state = self.states[rank]["engine"]["model"][i]
        if local not in state:
            raise UserError(f"{self.where}: rank {rank}'s chunk {i} has no {local} (a checkpoint of another layout)")
        return state[local]

    def state_keys(self, row: Resolved) -> list[str]:
        """The optimizer state tensors the checkpoint holds for `row` (`exp_avg`, ..., `param`)."""
        e = self._entries(row, self._replicas(row)[0][0])[0]
        return sorted(k for k in e if k not in ("range", "shape"))

    def _entries(self, row: Resolved, replicas: list[Holder]) -> list[dict[str, Any]]:
        """The optimizer state entries of `row`'s tensor on each of `replicas` (stored under its
        table name) that have one."""
        out = []
        for rank, *_ in replicas:
            named = {k: v for st in self.states[rank]["engine"]["optimizer"] for k, v in st.get("named", {}).items()}
            if not named:
                raise UserError(
                    f"{self.where} was written by an mbr that stored optimizer state by position: resume it once "
                    "with this mbr (checkpoint.resume=true) and let it save, then reshard that checkpoint (its "
                    "weights export as they are)"
                )
            key = self._alias.get(row.megatron, row.megatron)
            if key in named:
                out.append(named[key])
        if not out:
            raise UserError(f"{self.where}: no rank holds optimizer state for {row.megatron}")
        return out

    def state_shards(self, row: Resolved, key: str) -> list[torch.Tensor] | torch.Tensor:
        """Optimizer state `key` of `row` on each TP shard, each assembled from its replicas'
        ranges; a 0-dim state (`step`) once, as stored."""
        out = []
        for shard in self._replicas(row):
            runs = []
            for replicas in shard:
                entries = self._entries(row, replicas)
                if entries[0][key].dim() == 0:
                    return entries[0][key]
                runs.append(_assemble(entries, key, f"{self.where}: {row.megatron} {key}"))
            out.append(_join(runs))
        return out


def _join(runs: list[torch.Tensor]) -> torch.Tensor:
    return runs[0] if len(runs) == 1 else torch.cat(runs, 0)


def _assemble(entries: list[dict[str, Any]], key: str, what: str) -> torch.Tensor:
    """One shard's state from its replicas' flat ranges, which must tile it exactly (a plain
    optimizer's replicas each hold all of it: one is taken)."""
    shape = tuple(entries[0]["shape"])
    n = 1
    for d in shape:
        n *= d
    parts, at = [], 0
    for start, end, t in sorted(((*e["range"], e[key]) for e in entries), key=lambda x: (x[0], x[1])):
        if end <= at:  # a range already covered (another replica's copy)
            continue
        if start != at:
            raise UserError(f"{what}: the ranks' ranges leave elements {at}..{start} out")
        parts.append(t)
        at = end
    if at != n:
        raise UserError(f"{what}: the ranks' ranges cover {at} of {n} elements")
    return torch.cat(parts).view(shape)


class TrainingSource(Source):
    """The model's weights in a training checkpoint, as HF tensors row by row (a conversion Source)."""

    def __init__(self, ckpt: TrainingCheckpoint):
        super().__init__(None)
        self.ckpt, self.spec, self.where, self.expected = ckpt, ckpt.spec, ckpt.where, {}
        self.rows = ckpt.rows
        self.order = {r.megatron: i for i, r in enumerate(self.rows)}
        self.shapes = self.spec.shapes(ckpt.layout.tp)
        self.tensors = {}
        for r in (r for r in self.rows if r.mapping.export):
            metas = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in ckpt.weight_shards(r)]
            for name, t in zip(r.hf, r.mapping.merge(metas, self.shapes)):
                self.tensors[name] = (tuple(t.shape), dtype_of(t.dtype))

    def hf_tensors(self, row: Resolved) -> list[torch.Tensor]:
        src = row if row.mapping.export else next(r for r in self.rows if r.hf == row.hf and r.mapping.export)
        merged = list(src.mapping.merge(self.ckpt.weight_shards(src), self.shapes))
        return self._finish(src.hf, [t.contiguous() for t in merged], {})


__all__ = ["TrainingCheckpoint", "TrainingSource", "checkpoint_dir"]
