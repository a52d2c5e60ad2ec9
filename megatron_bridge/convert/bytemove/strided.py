"""Strided views of one tensor as byte moves: GPT-OSS's stacked experts, without torch.

`ExpertsStacked.blocks` describes an expert's megatron shard as strided blocks of the
expert's slab (`Block.step`, `transposed`: fc1's gate rows are the slab's even columns). The
byte copier reads the slab once into a reused buffer and gathers those rows (`Gather`);
export scatters the records back into the slab (`Scatter`). Both go through
`strided_copy`: stdlib `memoryview` element views, one C-speed strided slice per row, so
memory is about two expert tensors and the speed up to ~260 MB/s on this 2-core box
(docs/benchmarks.md, "Stacked experts"). `copier.Copier` runs them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Literal


class Mem:
    """Bytes held in memory standing in for a file region (an fp8 weight's bf16 dequantisation)."""

    def __init__(self, data: bytearray | memoryview):
        self.view = memoryview(data)


@dataclass(frozen=True)
class Gather:
    """A strided view of one stored matrix [R, C] of `itemsize`-byte elements at `start` of
    `file` (a 1-D tensor is [R, 1]): rows range(*rows) and columns [c0, c1) of it, or of its
    transpose if `transposed` (GPT-OSS's stacked experts, `Block.strided`). The matrix (one
    expert's tensor) is read once and gathered in memory with strided slices."""

    file: Path | Mem
    start: int
    shape: tuple[int, int]
    itemsize: int
    rows: tuple[int, int, int]
    cols: tuple[int, int]
    transposed: bool

    @property
    def nbytes(self) -> int:
        return len(range(*self.rows)) * (self.cols[1] - self.cols[0]) * self.itemsize

    @property
    def matrix_nbytes(self) -> int:
        """The stored matrix's bytes: what is read."""
        return self.shape[0] * self.shape[1] * self.itemsize


@dataclass(frozen=True)
class Scatter:
    """The inverse of `Gather` (export): a matrix [R, C] assembled in memory from parts
    `(file, start, rows, cols, transposed)` — each part's bytes are those view rows one
    after another, as a `Gather` with that geometry wrote them — then written whole."""

    shape: tuple[int, int]
    itemsize: int
    parts: tuple[tuple[Path, int, tuple[int, int, int], tuple[int, int], bool], ...]

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.itemsize

    def part_nbytes(self, rows: tuple[int, int, int], cols: tuple[int, int]) -> int:
        """A part's bytes in its file: its view rows × columns."""
        return len(range(*rows)) * (cols[1] - cols[0]) * self.itemsize


FORMATS: dict[int, Literal["B", "H", "I", "Q"]] = {
    1: "B",
    2: "H",
    4: "I",
    8: "Q",
}  # memoryview element formats by item size


def matrix(shape: Sequence[int]) -> tuple[int, int]:
    """A tensor's elements as a row-major matrix [rows, row length] (1-D: [n, 1])."""
    return (shape[0], prod(shape[1:])) if shape else (1, 1)


def strided_copy(
    dst: memoryview,
    src: memoryview,
    shape: tuple[int, int],
    rows: tuple[int, int, int],
    cols: tuple[int, int],
    transposed: bool,
    gather: bool,
) -> None:
    """Between a stored matrix of `shape` (`src` if `gather`, else `dst`) and its packed view
    rows `rows` (start, stop, step) x columns `cols` (of its transpose if `transposed`).
    Both are element views (`FORMATS`); each loop step is one C-speed strided slice, so a
    [2880, 5760] transpose is 2880 slices, not 16 M Python steps."""
    C = shape[1]
    r0, r1, step = rows
    c0, c1 = cols
    w, n = c1 - c0, len(range(r0, r1, step))

    def move(packed: slice, stored: slice) -> None:
        if gather:
            dst[packed] = src[stored]
        else:
            dst[stored] = src[packed]

    if not transposed and w == 1:  # one element per row (a 1-D bias): a single slice
        move(slice(0, n), slice(r0 * C + c0, r1 * C, step * C))
    elif transposed and n > w:  # stored row c0 + j is packed column j: loop the fewer (reads in order)
        for j in range(w):
            move(slice(j, n * w, w), slice((c0 + j) * C + r0, (c0 + j) * C + r1, step))
    else:  # packed row k is stored column r (transposed) or stored row r
        for k in range(n):
            r = r0 + k * step
            stored = slice(c0 * C + r, c1 * C, C) if transposed else slice(r * C + c0, r * C + c1)
            move(slice(k * w, (k + 1) * w), stored)


__all__ = ["Gather", "Scatter", "FORMATS", "matrix", "strided_copy"]
