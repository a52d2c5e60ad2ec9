"""CRC-32 of source tensors on a second thread: the manifest's end-to-end check of a byte move.

Every source tensor is still read once for its CRC-32, on a worker thread that trails the
copies (`Checksums.add` after a tensor's pieces are written), so it reads from the page
cache and runs on the other core. Kept apart from the copier: the copies never wait on it,
and export (direct_export.py) checks its output the same way.
"""

from __future__ import annotations

import queue
import threading

from megatron_bridge.convert.formats.finite import all_finite
from megatron_bridge.convert.formats.manifest import crc_hex
from megatron_bridge.convert.formats.mapped import crc32_range
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, TensorInfo


class Checksums:
    """CRC-32 of source tensors on a worker thread, in the order they are handed in (after
    their copies: from the page cache, on the other core). `result()` waits for all."""

    def __init__(self, check_finite: bool = False) -> None:
        self.values: dict[str, str] = {}
        self.check_finite = check_finite  # also note the tensors holding NaN or infinity (mbr convert)
        self.nonfinite: set[str] = set()
        self._q: queue.Queue[TensorInfo | None] = queue.Queue()
        self._error: BaseException | None = None
        self._t = threading.Thread(target=self._work, name="mbr-crc", daemon=True)
        self._t.start()

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
        except BaseException as e:  # re-raised by result()
            self._error = e
            while self._q.get() is not None:
                pass
        finally:
            files.close()

    def result(self) -> dict[str, str]:
        self._q.put(None)
        self._t.join()
        if self._error is not None:
            raise self._error
        return self.values

    def abandon(self) -> None:
        self._q.put(None)
        self._t.join()


__all__ = ["Checksums"]
