"""Where a conversion reads from: an HF directory, a torch_dist checkpoint, per-rank files.

Every source answers one question, row by row: "the HF tensors of this table row" — the
layout-free representation all writers start from. A per-rank checkpoint gathers the
row's TP (or expert-TP) shards and merges them with the row's own transform; a torch_dist
checkpoint reads the global tensor and merges it as a single shard; an HF directory just
reads. So every path goes through the same `Mapping.merge` / `Mapping.shard` /
`Mapping.to_global` the live loader uses, and nothing knows a layout twice.

Tensors are read one row at a time (positioned reads, no mmap), cast to the requested
dtype, and checked against the manifest's CRC-32 (checkpoint sources) or checksummed for
the new manifest (every source), so exports and reshards verify what they produce.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bridge.backends.registry import backend_of
from megatron_bridge.bridge.features.mtp import mtp_keys, note_skipped
from megatron_bridge.bridge.hf_config import read_hf_config
from megatron_bridge.bridge.mapping import Replicated
from megatron_bridge.bridge.spec import BridgeSpec
from megatron_bridge.bridge.table import Resolved
from megatron_bridge.convert.formats import fp8
from megatron_bridge.convert.formats.dist_ckpt import DistLocation
from megatron_bridge.convert.formats.dist_read import DistReader
from megatron_bridge.convert.formats.dtypes import BFLOAT16, FLOAT16, FLOAT32, DType
from megatron_bridge.convert.formats.manifest import Manifest, check_index_crc32, crc32
from megatron_bridge.convert.formats.pickle_guard import CONVERTED, Name
from megatron_bridge.convert.formats.readahead import READ_AHEAD_BYTES
from megatron_bridge.convert.formats.safetensors_io import PositionedReader, TensorInfo, scan_dir
from megatron_bridge.convert.formats.torch_zip import TensorRef
from megatron_bridge.convert.formats.torch_zip_read import LazyTorchFile, scan_torch_file
from megatron_bridge.convert.placement.manifest_model import manifest_layout, manifest_spec
from megatron_bridge.convert.placement.rank_files import RELEASE, RankFile, Target, all_targets
from megatron_bridge.convert.sources.rows import producers, resolve_rows
from megatron_bridge.errors import UserError

if TYPE_CHECKING:  # torch is imported where it is used: the byte paths never import it
    import torch

DTYPES = {"bf16": BFLOAT16, "fp32": FLOAT32, "fp16": FLOAT16, "source": None}
TensorTable = dict[str, tuple[tuple[int, ...], DType]]
PREFETCH_BYTES = 256 * 2**20  # tensors read ahead of the row being written (process memory)


def mismatch(where: str, name: str) -> UserError:
    """A tensor read back (tensors, or bytes: export, reshard) that its manifest's CRC-32 refuses."""
    return UserError(
        f"{where}: tensor {name} does not match its checksum in the manifest: the "
        "checkpoint files are corrupted or were modified after conversion"
    )


def parse_dtype(text: str) -> DType | None:
    if text not in DTYPES:
        raise UserError(f"dtype={text!r}: choose one of {', '.join(DTYPES)} (source keeps each tensor's dtype)")
    return DTYPES[text]


class Source:
    """Base: `rows`, `tensors` (stored shapes/dtypes), `hf_tensors(row)`, `checksums`."""

    spec: BridgeSpec
    rows: list[Resolved]  # in the order they are read
    order: dict[str, int]  # megatron name -> position in table order (layer, table row, expert)
    tensors: TensorTable
    where: str  # how messages name the source ("src=PATH")
    expected: dict[str, str]  # HF name -> CRC-32 the manifest records (none for an HF directory)
    byte_paths = True  # the byte engines may copy its records (they verify against `expected`)

    def __init__(self, dtype: DType | None):
        self.dtype = dtype  # None = keep the stored dtype
        self.io = PositionedReader()
        self.checksums: dict[str, str] = {}  # of the tensors as handed out (after the cast)
        self.check_finite = False  # note the tensors holding NaN or infinity (`mbr convert`'s HF source)
        self.nonfinite: set[str] = set()

    def out_dtype(self, name: str) -> DType:
        """The dtype `name` is written in: `dtype=`'s for floating-point tensors, the stored
        one otherwise (a model's integer buffers are never cast)."""
        stored = self.tensors[name][1]
        return self.dtype if self.dtype is not None and stored.is_floating_point else stored

    def count(self, row: Resolved) -> int:
        """HF tensors the row stands for (a stacked tensor counts with its expert 0 only, a tensor
        rows share with its first piece)."""
        piece = row.mapping.transform.piece
        if piece is not None:
            return len(row.hf) if piece[0] == 0 else 0
        return len(row.hf) if not row.mapping.transform.stacked or not row.expert else 0

    def nbytes(self, row: Resolved) -> int:
        """Bytes of the row's HF inputs (a stacked-experts row: its expert's share; a piece: its share)."""
        n = sum(prod(self.tensors[h][0]) * self.out_dtype(h).itemsize for h in row.hf)
        piece = row.mapping.transform.piece
        if piece is not None:
            return n // piece[1]
        return n // self.tensors[row.hf[0]][0][0] if row.mapping.transform.stacked else n

    def _finish(
        self, names: Sequence[str], tensors: Sequence[torch.Tensor], expected: dict[str, str]
    ) -> list[torch.Tensor]:
        """Check shapes and stored checksums, cast, record output checksums."""
        out = []
        for name, t in zip(names, tensors):
            shape, dtype = self.tensors[name]
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise UserError(
                    f"{self.where}: {name} comes back as {list(t.shape)} {t.dtype}, the manifest "
                    f"says {list(shape)} {dtype} (damaged checkpoint)"
                )
            if name in expected and name not in self.checksums and crc32(t) != expected[name]:
                raise mismatch(self.where, name)
            if self.check_finite and t.is_floating_point() and not bool(t.isfinite().all()):
                self.nonfinite.add(name)
            if self.dtype is not None and t.dtype != self.dtype and t.is_floating_point():
                t = t.to(self.dtype.torch)
            if name not in self.checksums:
                self.checksums[name] = (
                    expected[name] if (name in expected and self.dtype in (None, dtype)) else crc32(t)
                )
            out.append(t)
        return out

    def hf_tensors(self, row: Resolved) -> list[torch.Tensor]:
        raise NotImplementedError

    def ranges(self, row: Resolved) -> list[tuple[Path, int, int]]:
        """(file, start, length) byte ranges `hf_tensors(row)` will read (for read-ahead)."""
        return []

    def stream(
        self,
        rows: Sequence[Resolved],
        prepare: Callable[[Resolved, list[torch.Tensor]], Any] | None = None,
        budget: int = PREFETCH_BYTES,
    ) -> Iterator[tuple[Resolved, Any]]:
        """(row, prepare(row, HF tensors)) in order; a worker thread reads and prepares ahead
        while the caller writes.

        Reading, checksumming and the tensor work of `prepare` (the writer's layout transform)
        release the GIL, so the disk, the transforms and the writes overlap on two cores. The
        worker stays at most `budget` bytes ahead of the row the caller holds (a row bigger
        than that waits until the caller has released the previous one), so read-ahead adds at
        most `budget` to the peak memory, whatever the model size."""
        cond, held, stop = threading.Condition(), 0, False  # bytes handed out and not yet released; caller gone
        out: queue.Queue = queue.Queue()

        def room_for(n: int) -> bool:
            return stop or held == 0 or held + n <= budget

        def work() -> None:
            nonlocal held
            advised, pending = 0, 0  # rows handed to the kernel's read-ahead, their bytes not yet read
            try:
                for i, r in enumerate(rows):
                    while advised < len(rows) and (advised <= i or pending < READ_AHEAD_BYTES):
                        for path, start, length in self.ranges(rows[advised]):
                            self.io.advise(path, start, length)
                            pending += length
                        advised += 1
                    pending -= sum(length for _, _, length in self.ranges(r))
                    n = self.nbytes(r)
                    with cond:
                        cond.wait_for(functools.partial(room_for, n))
                        if stop:
                            return
                        held += n
                    hf = self.hf_tensors(r)
                    out.put((r, prepare(r, hf) if prepare is not None else hf, n))
                    del hf
                out.put(None)
            except BaseException as e:  # re-raised in the caller's thread
                out.put(e)

        worker = threading.Thread(target=work, name="mbr-read-ahead", daemon=True)
        worker.start()
        try:
            while True:
                item = out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                r, tensors, n = item
                del item
                yield r, tensors
                del tensors
                with cond:
                    held -= n
                    cond.notify_all()
        finally:
            with cond:
                stop = True
                cond.notify_all()
            worker.join()

    def close(self) -> None:
        self.io.close()


class HFSource(Source):
    """A Hugging Face model directory (config.json + safetensors, sharded or not)."""

    def __init__(
        self, path: Path, dtype: DType | None, describe: Callable[[dict[str, Any]], BridgeSpec], arg: str = "src"
    ):
        """`describe(config)`: the model description of this directory's (dequantised)
        config.json — the command's `backends.describe` with its recipe's vocab padding; `arg`:
        how the command line names the directory."""
        super().__init__(dtype)
        self.where, self.expected = f"{arg}={path}", {}
        self.check_finite = True
        if (path / "mbr_manifest.json").is_file():
            raise UserError(
                f"{self.where} is already a converted checkpoint: use `mbr reshard` to change its layout "
                "or format, `mbr export` to get a Hugging Face directory back"
            )
        config = read_hf_config(path, arg=arg)
        block = fp8.block_size(config, self.where)
        # An fp8 checkpoint reads as its bf16 dequantisation (formats/fp8.py): the scales are
        # consumed, and the config written (and recorded) is the dequantised model's.
        self.hf_config = fp8.without_quantization(config) if block else config
        self.spec = describe(self.hf_config)
        stored = scan_dir(path)
        check_index_crc32(path)  # an export of ours: its files' recorded CRC-32 first
        quant = fp8.pair(stored, block, self.where)
        tensors = fp8.dequantized_infos(stored, quant)
        # multi-token prediction: not converted, said so (counted as the loader counts: scales consumed)
        skip = set(mtp_keys(self.spec, list(tensors)))
        if skip:
            note_skipped(self.spec, sorted(skip))
        self.quant: dict[str, fp8.Quantized] = {k: v for k, v in quant.items() if k not in skip}
        self.tensors = {k: v for k, v in tensors.items() if k not in skip}
        self.infos: dict[str, TensorInfo] = {k: v for k, v in stored.items() if k in self.tensors}
        integers = backend_of(self.spec).integer_tensors(self.spec)  # the model's own integer buffers
        bad = sorted(
            {str(v.dtype) for k, v in self.infos.items() if not v.dtype.is_floating_point and k not in integers}
        )
        if bad:
            raise UserError(
                f"{self.where}: non-floating-point weights ({', '.join(bad)}): quantized checkpoints are not supported"
            )
        rows = resolve_rows(self.spec, self.tensors, where=self.where)
        self.order = {r.megatron: i for i, r in enumerate(rows)}
        # Read in file order: sequential I/O, and what read_ahead_source fetched comes first.
        files = {f: i for i, f in enumerate(sorted({v.file for v in self.infos.values()}))}
        self.rows = sorted(rows, key=lambda r: min((files[self.infos[h].file], self.infos[h].start) for h in r.hf))

    def _read(self, name: str) -> torch.Tensor:
        q = self.quant.get(name)
        return self.io.read(self.infos[name]) if q is None else fp8.read_torch(q, self.io.read_bytes)

    def hf_tensors(self, row: Resolved) -> list[torch.Tensor]:
        return self._finish(row.hf, [self._read(h) for h in row.hf], self.expected)

    def ranges(self, row: Resolved) -> list[tuple[Path, int, int]]:
        out: list[tuple[Path, int, int]] = []
        for h in row.hf:
            q = self.quant.get(h)
            out += fp8.read_range(q) if q else [(self.infos[h].file, self.infos[h].start, self.infos[h].nbytes)]
        return out


class CheckpointSource(Source):
    """Shared by the two checkpoint formats: manifest, rows, checksums."""

    def __init__(self, path: Path, man: Manifest, dtype: DType | None):
        super().__init__(dtype)
        self.where, self.man = f"src={path}", man
        self.assets_dir: Path = path  # where the manifest's assets are (export and reshard copy them)
        self.config_file: Path | None = path / "config.json"  # copied by reshard (None: written from man.hf_config)
        man.check_files(path)
        self.spec = manifest_spec(man)
        self.layout = manifest_layout(man)
        tensors = man.tensor_table()
        self.use_rows(tensors, resolve_rows(self.spec, tensors, tp=self.layout.tp, where=self.where))
        self.expected = {k: v["crc32"] for k, v in man.tensors.items()}

    def use_rows(self, tensors: TensorTable, rows: list[Resolved]) -> None:
        """The HF tensors and the rows read, in order, and what is derived from them."""
        self.tensors, self.rows = tensors, rows
        self.order = {r.megatron: i for i, r in enumerate(self.rows)}
        self.producer = producers(self.rows)
        self.shapes = self.spec.shapes(self.layout.tp)
        # stacked-experts tensors (GPT-OSS): the rows of their experts, in expert order
        self._experts: dict[tuple[str, ...], list[Resolved]] = {}
        for r in self.rows:
            if (r.mapping.transform.stacked or r.mapping.transform.piece) and r.mapping.export:
                self._experts.setdefault(r.hf, []).append(r)
        for rs in self._experts.values():  # expert order, or piece order (`Transform.piece`)
            rs.sort(key=lambda r: r.expert or (r.mapping.transform.piece or (0,))[0])
        self._stack: tuple[tuple[str, ...], list[torch.Tensor]] | None = None

    def source_row(self, row: Resolved) -> Resolved:
        """The exported row that stores `row`'s HF tensors: itself, or for the tied output
        layer the embedding (the experts of a stacked tensor share its name: not a key)."""
        return row if row.mapping.export else self.producer[row.hf]

    def merged(self, row: Resolved) -> list[torch.Tensor]:
        """The HF tensors exported row `row` stores (a stacked row: its expert's slabs)."""
        raise NotImplementedError

    def hf_tensors(self, row: Resolved) -> list[torch.Tensor]:
        """A stacked-experts row gets the whole stacked tensors (what `Resolved.select`
        takes its slab from), put together from every expert's records once and kept
        while that tensor's expert rows follow each other."""
        src = self.source_row(row)
        if not (src.mapping.transform.stacked or src.mapping.transform.piece):
            return self._finish(src.hf, self.merged(src), self.expected)
        if self._stack is None or self._stack[0] != src.hf:  # pieces of one tensor (a fused q/k/v) likewise
            import torch

            self._stack = None
            slabs = [self.merged(r) for r in self._experts[src.hf]]
            whole = [torch.cat([s[k] for s in slabs], dim=0) for k in range(len(src.hf))]
            del slabs
            self._stack = (src.hf, self._finish(src.hf, whole, self.expected))
        return self._stack[1]


class DistSource(CheckpointSource):
    """A torch_dist checkpoint: each row is one global tensor, merged back to HF as one shard."""

    def __init__(self, path: Path, man: Manifest, dtype: DType | None):
        super().__init__(path, man, dtype)
        self.reader = DistReader(path / RELEASE, self.io)

    def location(self, name: str) -> DistLocation:
        """Where megatron parameter `name` is stored (its backend's key)."""
        return backend_of(self.spec).dist_location(self.spec, name)

    def whole_key(self, name: str) -> str | None:
        """The key holding parameter `name` as one record (None: stored in parts)."""
        return self.location(name).key

    def merged(self, row: Resolved) -> list[torch.Tensor]:
        g = self.reader.read(self.location(row.megatron))
        return list(row.mapping.merge([g], self.shapes))

    def ranges(self, row: Resolved) -> list[tuple[Path, int, int]]:
        return self.reader.ranges(self.location(self.source_row(row).megatron))


class TorchSource(CheckpointSource):
    """Per-rank files: a row's shards are gathered from the files that hold one replica
    (EP rank 0 for dense rows, the owning EP rank for experts; every TP rank) and merged."""

    MAX_OPEN = 64
    standins: Mapping[Name, Any] | None = None  # what its pickles' names load as besides data (LazyTorchFile's extra)

    def __init__(self, path: Path, man: Manifest, dtype: DType | None):
        super().__init__(path, man, dtype)
        scan_rank_files(path, man)  # refused before anything is written, not mid-way
        self.root = path
        if self.layout.etp not in (None, self.layout.tp):
            raise UserError(f"{self.where}: per-rank checkpoints with etp != tp are not supported")
        self.targets = all_targets(self.spec, self.layout, [r for r in self.rows if r.mapping.export])
        self._files: OrderedDict[RankFile, LazyTorchFile] = OrderedDict()

    def file(self, f: RankFile) -> LazyTorchFile:
        if f in self._files:
            self._files.move_to_end(f)
        else:
            self._files[f] = LazyTorchFile(self.path_of(f), self.io, extra=self.standins)
            if len(self._files) > self.MAX_OPEN:
                self._files.popitem(last=False)
        return self._files[f]

    def path_of(self, f: RankFile) -> Path:
        """Where rank file `f` is."""
        return self.root / f.relpath(self.layout)

    def stored(self, f: LazyTorchFile, t: Target) -> TensorRef | None:
        """`t`'s record in its rank file `f`, or None."""
        chunk = f.obj.get(t.chunk) if isinstance(f.obj, dict) else None
        ref = chunk.get(t.local) if isinstance(chunk, dict) else None
        return ref if isinstance(ref, TensorRef) else None

    def ref(self, t: Target) -> tuple[LazyTorchFile, TensorRef]:
        """The rank file holding `t` and its record of it."""
        f = self.file(t.file)
        ref = self.stored(f, t)
        if ref is None:
            raise UserError(
                f"{self.path_of(t.file)} has no {t.chunk}/{t.local} (not the layout its manifest records, or damaged)"
            )
        return f, ref

    def _read(self, t: Target) -> torch.Tensor:
        f, ref = self.ref(t)
        return f.read(ref)

    def replica(self, row: Resolved) -> tuple[Resolved, list[list[Target]]]:
        """The exported row behind `row` and the shards of one replica of it, in TP order; each
        shard is the targets joined on dim 0 to make it: one, or for a tensor stacking every
        expert (`Backend.ep_stacked`) every EP rank's run of them, in EP order."""
        src = self.source_row(row)
        targets = self.targets.get(src.megatron, [])
        if src.mapping.is_expert:
            replica = [[t] for t in sorted(targets, key=lambda t: t.coords.etp_rank)]
        elif backend_of(self.spec).ep_stacked(self.spec, src):
            by_tp: dict[int, list[Target]] = {}
            for t in sorted(targets, key=lambda t: (t.coords.tp_rank, t.coords.ep_rank)):
                by_tp.setdefault(t.coords.tp_rank, []).append(t)
            replica = list(by_tp.values())
        else:
            replica = [
                [t] for t in sorted((t for t in targets if t.coords.ep_rank == 0), key=lambda t: t.coords.tp_rank)
            ]
        tf = src.mapping.transform
        return src, replica[:1] if isinstance(getattr(tf, "inner", tf), Replicated) or tf.whole else replica

    def merged(self, row: Resolved) -> list[torch.Tensor]:
        src, replica = self.replica(row)
        shards = [self._joined(group) for group in replica]
        return list(src.mapping.merge(shards, self.shapes))

    def _joined(self, group: list[Target]) -> torch.Tensor:
        if len(group) == 1:
            return self._read(group[0])
        import torch

        return torch.cat([self._read(t) for t in group], 0)

    def ranges(self, row: Resolved) -> list[tuple[Path, int, int]]:
        out = []
        for t in (t for group in self.replica(row)[1] for t in group):
            f = self.file(t.file)
            ref = self.stored(f, t)
            if ref is not None:
                out.append(f.range(ref))
        return out


def scan_rank_files(path: Path, man: Manifest) -> None:
    """Every `torch.save` file of a per-rank checkpoint names only data (`CONVERTED`)."""
    for rel in man.files:
        if rel.endswith(".pt"):
            scan_torch_file(path / rel, CONVERTED)


def open_checkpoint(path: Path, dtype: DType | None) -> CheckpointSource:
    man = Manifest.read(path)
    return (DistSource if man.format == "torch_dist" else TorchSource)(path, man, dtype)


__all__ = [
    "Source",
    "HFSource",
    "CheckpointSource",
    "DistSource",
    "TorchSource",
    "open_checkpoint",
    "parse_dtype",
    "DTYPES",
]
