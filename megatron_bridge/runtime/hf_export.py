"""Writing an HF export's files, in the step or behind the training loop.

`export_hf_weights` (runtime/weights.py) gathers each full tensor (collectives over TP/EP: the
training thread's work, in the same order on every rank) and hands it to an `HFExport`, which
writes this rank's safetensors file and its CRC-32; rank 0 then writes the index (recording
every file's CRC-32, which `train.init_from` and `mbr convert` check) and config.json.

* In the step (`buffer_bytes=0`): each tensor is appended to the rank's spill as it arrives
  (runtime/safetensors_stream.py), so host memory holds one tensor; `finish()` returns once
  every rank's file is in.
* Behind the loop (`train.export_interval` with `train.export_buffer_bytes > 0`): the training
  thread still gathers, copies each tensor to host and queues it; a writer thread appends it to
  the spill, assembles the file and (rank 0) the index and config. The queue holds at most
  `buffer_bytes` (the training thread waits while it is full), so a rank's extra host memory
  is `buffer_bytes` plus the largest tensor whatever the model's size, and the step pays the
  gathers and host copies plus whatever the disk has not absorbed beyond the buffer. Training
  goes on while the writer finishes; `written_everywhere()` (one scalar all-reduce) tells the
  loop when `finish()` will not wait. What is queued is never a parameter's memory (the
  exporter's tensors are gathered or cloned; on a GPU the host copy is made here): the next
  optimizer step cannot change what is written.

`finish()` is collective: a rank whose writing failed makes every rank raise, naming it, and
nothing is published; with `publish_as`, rank 0 renames the directory once every file is in
(a reader never sees a partial export).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_bridge.convert.formats.manifest import file_crc32
from megatron_bridge.runtime.groups import comm_device
from megatron_bridge.runtime.safetensors_stream import StreamingSafetensors

# rank 0, once every file is in: (dir, [(tensor, file, bytes)], {file: CRC-32}) -> index + config
Index = Callable[[Path, list[tuple[str, str, int]], dict[str, str]], None]


@dataclass(frozen=True)
class _Last:
    """The writer's last piece, known once every rank's names are: this rank's file name (None:
    it writes none)."""

    fname: str | None


class HFExport:
    """One rank's part of an HF export: started by the constructor (collective), ended by
    `finish()` (collective)."""

    def __init__(
        self,
        out: Path,
        tensors: Iterable[tuple[str, torch.Tensor]],
        write_index: Index,
        *,
        buffer_bytes: int = 0,
        publish_as: Path | None = None,
    ) -> None:
        dist = torch.distributed
        self.out, self.publish_as, self.rank = out, publish_as, dist.get_rank()
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()  # the directory exists before any rank spills into it
        self._spill = StreamingSafetensors(out / f".rank{self.rank:05d}.spill")
        self._error: BaseException | None = None
        self._queue: deque[tuple[str, torch.Tensor] | tuple[None, _Last | None]] = deque()
        self._queued, self._limit = 0, buffer_bytes
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._crc: str | None = None  # this rank's file's CRC-32, once written
        self._write_index, self._rows = write_index, list[tuple[str, str, int]]()
        if buffer_bytes > 0:  # a daemon: a job that dies mid-write leaves an unpublished directory
            self._thread = threading.Thread(target=self._drain, name="mbr-hf-export", daemon=True)
            self._thread.start()
        sizes: list[tuple[str, int]] = []
        try:
            for name, t in tensors:
                sizes.append((name, t.numel() * t.element_size()))
                if self._thread is None:
                    self._spill.add(name, t)  # on disk at once: host memory holds one tensor
                else:
                    self._put(name, t.detach().to("cpu"))  # new memory already (iter_hf_tensors)
        except BaseException:
            self._end(None)
            self._spill.discard()
            raise
        listing: list[list[tuple[str, int]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(listing, sorted(sizes))
        writers = [r for r, names in enumerate(listing) if names]
        files = {r: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, r in enumerate(writers)}
        seen: dict[str, int] = {}
        for r in writers:
            for k, _ in listing[r]:
                if k in seen:
                    self._end(None)
                    self._spill.discard()
                    raise RuntimeError(f"{k} exported by ranks {seen[k]} and {r}")
                seen[k] = r
        if self.rank == 0:
            self._rows = [(k, files[r], n) for r in writers for k, n in listing[r]]
        self._end(_Last(files.get(self.rank)))

    # -- the writer ------------------------------------------------------------------------------
    def _put(self, name: str, host: torch.Tensor) -> None:
        nbytes = host.numel() * host.element_size()
        with self._cv:  # a full buffer waits for the writer (always admits one tensor)
            self._cv.wait_for(lambda: self._queued == 0 or self._queued + nbytes <= self._limit)
            self._queue.append((name, host))
            self._queued += nbytes
            self._cv.notify_all()

    def _end(self, job: _Last | None) -> None:
        """The last piece to complete, or None to abandon the export."""
        if self._thread is None:
            if job is not None:
                self._complete(job)
            return
        with self._cv:
            self._queue.append((None, job))
            self._cv.notify_all()
        if job is None:
            self._thread.join()

    def _drain(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                name, item = self._queue.popleft()
            if not isinstance(item, torch.Tensor):
                if item is not None and self._error is None:
                    self._record(self._complete, item)
                return
            if self._error is None:  # after a failure the rest is only drained, so nothing waits
                self._record(self._spill.add, name, item)
            with self._cv:
                self._queued -= item.numel() * item.element_size()
                self._cv.notify_all()

    def _record(self, fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except BaseException as e:  # reported by finish() on every rank, not lost in the thread
            self._error = e

    def _complete(self, last: _Last) -> None:
        if last.fname is None:
            self._spill.discard()
        else:
            self._spill.finish(self.out / last.fname, metadata={"format": "pt"})
            self._crc = file_crc32(self.out / last.fname)  # read back (cached): the index records it

    # -- the loop's side ---------------------------------------------------------------------------
    def written_everywhere(self) -> bool:
        """Collective (one scalar all-reduce): has every rank's writer finished?"""
        done = self._thread is None or not self._thread.is_alive()
        flag = torch.tensor([1.0 if done else 0.0], device=comm_device())
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def finish(self) -> Path:
        """Collective: wait for this rank's writer; every rank raises if any rank's failed;
        rank 0 renames to `publish_as`. Returns where the export is."""
        if self._thread is not None:
            self._thread.join()
        dist = torch.distributed
        got: list[tuple[str | None, str | None]] = [(None, None)] * dist.get_world_size()
        mine = None if self._error is None else f"{type(self._error).__name__}: {self._error}"
        dist.all_gather_object(got, (mine, self._crc))
        failed = [f"rank {r}: {e}" for r, (e, _) in enumerate(got) if e]
        if failed:
            raise RuntimeError(f"the HF export to {self.out} was not written: " + "; ".join(failed))
        final = self.publish_as or self.out
        if self.rank == 0:
            files = dict.fromkeys(f for _, f, _ in self._rows)  # in rank order, as the CRCs are
            self._write_index(self.out, self._rows, dict(zip(files, (c for _, c in got if c is not None))))
            if self.publish_as is not None:
                if self.publish_as.is_dir():  # the same step exported before a resume: this one replaces it
                    shutil.rmtree(self.publish_as)
                os.replace(self.out, self.publish_as)
        dist.barrier()
        return final


__all__ = ["HFExport"]
