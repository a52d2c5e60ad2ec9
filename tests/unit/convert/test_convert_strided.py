"""Strided blocks (GPT-OSS's stacked experts) as byte moves, against the torch transform.

`ExpertsStacked.blocks` describes one expert's megatron shard as transposed and/or
stepped views of the expert's slab; the byte copier gathers them with stdlib strided
slices (`strided.Gather`) and export scatters them back (`strided.Scatter`). Both are
compared here with `ExpertsStacked.shard` / the slab itself, for every kind, every
expert-TP split the transforms allow, and 1-, 2- and 4-byte elements.
"""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest
import torch

from megatron_bridge.bridge.mapping import GATE_UP, REPLICATED, ROW
from megatron_bridge.bridge.shards import Shapes, Shard
from megatron_bridge.bridge.stacked import ExpertsStacked
from megatron_bridge.convert.bytemove import direct_export, strided
from megatron_bridge.convert.bytemove.copier import Copier
from megatron_bridge.convert.bytemove.pieces import pieces
from megatron_bridge.convert.formats.dtypes import BFLOAT16, FLOAT32, DType
from megatron_bridge.convert.formats.safetensors_io import TensorInfo

SHAPES = Shapes(4, 2, 8, 250, 256)
E, HID, INTER = 3, 8, 12
CASES = [
    ("gate_up", (E, HID, 2 * INTER), GATE_UP),
    ("gate_up", (E, 2 * INTER), GATE_UP),  # bias: 1-D, stepped, not transposed
    ("linear", (E, INTER, HID), ROW),
    ("same", (E, HID), REPLICATED),
]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


@pytest.mark.parametrize("dtype", [BFLOAT16, FLOAT32], ids=str)
@pytest.mark.parametrize("kind,shape,inner", CASES, ids=[f"{k}-{len(s)}d" for k, s, _ in CASES])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_gather_is_the_shard_and_scatter_gives_the_slab_back(tmp_path, kind, shape, inner, n, dtype: DType):
    t = ExpertsStacked(inner, kind)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(n)).to(dtype.torch)
    src = tmp_path / "src.bin"
    _write(src, b"\0" * 7 + _bytes(w))  # an odd offset, as in a safetensors file
    slab_bytes = w[0].numel() * dtype.itemsize
    copier = Copier()
    for e in range(E):
        info = TensorInfo("w", dtype, (1, *shape[1:]), src, 7 + e * slab_bytes, 7 + (e + 1) * slab_bytes)
        records = []
        for r in range(n):
            blocks = t.blocks([info.shape], Shard(r, n), SHAPES)
            want = t.shard([w[e : e + 1]], Shard(r, n), SHAPES)
            out = tmp_path / f"shard{r}.bin"
            fd = os.open(out, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
            try:
                assert copier.write(pieces(blocks, [info]), fd, 3) == want.numel() * dtype.itemsize
            finally:
                os.close(fd)
            assert out.read_bytes()[3:] == _bytes(want), (e, r)
            records.append((Shard(r, n), (out, 3, tuple(want.shape))))
        # export: the shards' records scattered back into the expert's slab (one replica)
        records = records[:1] if kind == "same" else records
        row = types.SimpleNamespace(mapping=types.SimpleNamespace(transform=t), megatron=f"expert {e}")
        ps = direct_export._pieces(row, 0, [info.shape], records, dtype.itemsize, SHAPES)  # type: ignore[arg-type]
        assert ps is not None
        back = tmp_path / "back.bin"
        fd = os.open(back, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            copier.write(ps, fd, 0)
        finally:
            os.close(fd)
        assert back.read_bytes() == _bytes(w[e]), e
    copier.close()


def test_strided_copy_transposes_both_ways():
    """Either loop order (per packed row, per stored row) gives the transpose."""
    R, C = 5, 7
    m = bytearray(range(R * C))
    for rows, cols in (((0, C, 1), (0, R)), ((1, C, 2), (1, 4)), ((0, 2, 1), (0, R))):
        n, w = len(range(*rows)), cols[1] - cols[0]
        out = bytearray(n * w)
        strided.strided_copy(memoryview(out), memoryview(m), (R, C), rows, cols, True, gather=True)
        want = [m[i * C + r] for r in range(*rows) for i in range(*cols)]
        assert list(out) == want
        back = bytearray(R * C)
        strided.strided_copy(memoryview(back), memoryview(out), (R, C), rows, cols, True, gather=False)
        assert all(back[i * C + r] == m[i * C + r] for r in range(*rows) for i in range(*cols))


def test_scatter_refuses_views_that_do_not_tile():
    assert direct_export._tiles((4, 6), (((0, 6, 2), (0, 4), True), ((1, 6, 2), (0, 4), True)))
    assert not direct_export._tiles((4, 6), (((0, 6, 2), (0, 4), True),))  # odd columns missing
    assert not direct_export._tiles((4, 6), (((0, 6, 1), (0, 4), True), ((1, 6, 2), (0, 4), True)))  # twice
