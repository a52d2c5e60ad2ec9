"""CRC-32 of source tensors on threads of their own: the manifest's end-to-end check of a byte move.

Every source tensor is still read once for its CRC-32, on worker threads that trail the
copies (`Checksums.add` after a tensor's pieces are written), so they read from the page
cache. Kept apart from the copier: the copies never wait on them, and export
(direct_export.py) checks its output the same way. As many threads as the copies have
workers: with one, the CRCs (and mbr convert's finite check) of the last tensors were still
running on one core for ~0.75 s after a 1.67 GB conversion's copies had ended on two
(docs/benchmarks.md, "After the copies").
"""

from __future__ import annotations

import queue
import threading

from megatron_bridge.convert.formats.finite import all_finite
from megatron_bridge.convert.formats.manifest import crc_hex
from megatron_bridge.convert.formats.mapped import crc32_range
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, TensorInfo


class Checksums:
    """CRC-32 of source tensors on `threads` worker threads, taken in the order they are handed
    in (after their copies: from the page cache). `result()` waits for all."""

    def __init__(self, check_finite: bool = False, threads: int = 1) -> None:
        self.values: dict[str, str] = {}
        self.check_finite = check_finite  # also note the tensors holding NaN or infinity (mbr convert)
        self.nonfinite: set[str] = set()
        self._q: queue.Queue[TensorInfo | None] = queue.Queue()
        self._error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._work, name=f"mbr-crc-{i}", daemon=True) for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def add(self, info: TensorInfo) -> None:
        if info.name not in self.values:
            self.values[info.name] = ""  # queued
            self._q.put(info)

    def _work(self) -> None:
        files = OpenFiles()
        try:
            while (info := self._q.get()) is not None:

                def finite(view: memoryview, info: TensorInfo = info) -> None:
                    if info.name not in self.nonfinite and not all_finite(info.dtype, view):
                        self.nonfinite.add(info.name)

                each = finite if self.check_finite else None
                crc = crc32_range(files(info.file), info.start, info.end, info.file, each=each)
                self.values[info.name] = crc_hex(crc)
        except BaseException as e:  # re-raised by result(); each thread ends on one None, as without an error
            self._error = self._error or e
            while self._q.get() is not None:
                pass
        finally:
            files.close()

    def _join(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join()
        self._threads = []

    def result(self) -> dict[str, str]:
        self._join()
        if self._error is not None:
            raise self._error
        return self.values

    def abandon(self) -> None:
        self._join()


__all__ = ["Checksums"]
