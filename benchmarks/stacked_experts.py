"""Speed of the byte mover on GPT-OSS's stacked expert tensors (no torch, no numpy).

    python benchmarks/stacked_experts.py [HIDDEN] [INTER] [REPEATS]   # defaults 2880 2880 3

One expert of GPT-OSS-120B: `gate_up_proj` slab [hidden, 2·inter] bf16 stored transposed
with gate/up interleaved, `down_proj` slab [inter, hidden]. Times, per expert, the convert
direction (`Copier.write` of `ExpertsStacked.blocks` as `strided.Gather` pieces: read the
slab, strided-gather the megatron fc1 = [gate; up] / fc2 rows, write) and the export
direction (`strided.Scatter`: read the record, scatter back, write), on files in /dev/shm
(tmpfs: the page cache, no disk), and checks that export gives the slab back bit for bit.
Prints MB/s of tensor bytes. The values are random bytes: a byte move does not care.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from megatron_bridge.bridge.mapping import GATE_UP, ROW
from megatron_bridge.bridge.shards import FULL, Shapes
from megatron_bridge.bridge.stacked import ExpertsStacked
from megatron_bridge.convert.bytemove import strided
from megatron_bridge.convert.bytemove.copier import Copier
from megatron_bridge.convert.bytemove.pieces import pieces
from megatron_bridge.convert.formats.dtypes import BFLOAT16
from megatron_bridge.convert.formats.safetensors_io import TensorInfo

SHAPES = Shapes(64, 8, 64, 201088, 201088)


def bench(name: str, t: ExpertsStacked, slab: tuple[int, int], root: Path, repeats: int) -> None:
    nbytes = slab[0] * slab[1] * 2
    src, rec, back = root / f"{name}.src", root / f"{name}.rec", root / f"{name}.back"
    src.write_bytes(os.urandom(nbytes))
    info = TensorInfo(name, BFLOAT16, (1, *slab), src, 0, nbytes)
    blocks = t.blocks([info.shape], FULL, SHAPES)
    copier = Copier()
    fd = os.open(rec, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    best = float("inf")
    for _ in range(repeats):
        copier._held = None  # read the slab again each time (from the page cache)
        t0 = time.perf_counter()
        copier.write(pieces(blocks, [info]), fd, 0)
        best = min(best, time.perf_counter() - t0)
    os.close(fd)
    print(f"{name} {list(slab)} bf16 convert (gather): {best * 1e3:7.1f} ms  {nbytes / best / 1e6:7.0f} MB/s")
    geo = tuple(
        ((b.rows[0], b.rows[1], b.step), b.cols or (0, slab[0] if b.transposed else slab[1]), b.transposed)
        for b in blocks
    )
    parts, pos = [], 0
    for b, g in zip(blocks, geo):
        parts.append((rec, pos, *g))
        pos += b.n * (g[1][1] - g[1][0]) * 2
    piece = strided.Scatter(slab, 2, tuple(parts))
    fd = os.open(back, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copier.write([piece], fd, 0)
        best = min(best, time.perf_counter() - t0)
    os.close(fd)
    copier.close()
    assert back.read_bytes() == src.read_bytes(), "export did not give the slab back"
    print(f"{name} {list(slab)} bf16 export (scatter): {best * 1e3:7.1f} ms  {nbytes / best / 1e6:7.0f} MB/s")


def main() -> None:
    hidden, inter, repeats = (int(a) for a in (sys.argv[1:] + ["2880", "2880", "3"][len(sys.argv) - 1 :])[:3])
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        bench("gate_up_proj", ExpertsStacked(GATE_UP, "gate_up"), (hidden, 2 * inter), Path(d), repeats)
        bench("down_proj", ExpertsStacked(ROW, "linear"), (inter, hidden), Path(d), repeats)


if __name__ == "__main__":
    main()
