"""FP8 block-quantised checkpoints (DeepSeek-V3, Kimi-K2): weights dequantised to bf16 as they are read.

Such a checkpoint stores a linear layer's `X.weight` as `float8_e4m3fn` with a sibling
`X.weight_scale_inv` (fp32, one scale per `weight_block_size` block, 128 x 128 on the hub;
the last block of a dimension that is not a multiple of 128 is partial), and config.json
says so in `quantization_config` (quant_method "fp8", fmt "e4m3", activation_scheme
"dynamic"). Every reader here sees the pair as ONE bf16 tensor named `X.weight` (the scale is
consumed) with the value of transformers' dequantisation (`Fp8Dequantize._dequantize_one`)
and DeepSeek's `weight_dequant`: `bf16(fp32(w[i, j]) * scale[i // 128, j // 128])` — the
product in fp32 (rounded to nearest even), then rounded to bf16 (nearest even), as
`(w.float() * s).to(torch.bfloat16)` does.

Two implementations, bit-identical (tests/unit/convert/test_fp8_source.py):

* `dequant_rows` (no torch, no numpy: the dependency-free reference): for a fixed block
  scale the output is a function of the fp8 byte alone, so each block gets two 256-entry
  tables (low and high byte of the bf16 result, built with one fp32 rounding through
  `array('f')`) and its rows are mapped with `bytes.translate`; the two byte planes are
  interleaved with strided slice assignment. C speed per 128-byte segment, no per-element
  Python. Works one block row (128 rows) at a time, so memory is the output plus one block row.
* `dequant_numpy`, what `dequantize` (the convert path) runs: the same two-step table per
  block, built for all blocks of a block row at once, and one gather (`np.take`) of the
  uint16 results per block row — ~10x `dequant_rows` (docs/benchmarks.md). `dequant_rows`
  stays as the dependency-free reference it is tested against.
* `dequant_torch` for the tensor paths (casts, the live loader), in row chunks.
"""

from __future__ import annotations

import mmap
import threading
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from math import ceil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_bridge.convert.formats.dtypes import BFLOAT16, BY_ST, FLOAT32, DType
from megatron_bridge.convert.formats.mapped import mapped
from megatron_bridge.convert.formats.safetensors_io import OpenFiles, TensorInfo, read_exactly
from megatron_bridge.errors import UserError

if TYPE_CHECKING:
    import torch

FP8 = BY_ST["F8_E4M3"]
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv


def _e4m3(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return float("nan")  # e4m3fn: no infinities, one NaN per sign
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


E4M3: tuple[float, ...] = tuple(_e4m3(b) for b in range(256))


@dataclass(frozen=True)
class Quantized:
    """An fp8 weight and its block scales, read as one bf16 tensor of the weight's shape."""

    weight: TensorInfo
    scale: TensorInfo
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight.shape


def block_size(hf_config: Mapping[str, Any], where: str) -> tuple[int, int] | None:
    """The block size of an fp8 `quantization_config` (None: the checkpoint is not quantised);
    anything this reader cannot reproduce is refused with the reason."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    problems = []
    if method != "fp8":
        problems.append(f"quant_method={method!r} (only block-wise 'fp8' checkpoints are dequantised)")
    if fmt != "e4m3":
        problems.append(f"fmt={fmt!r} (only e4m3 weights)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme={q.get('activation_scheme')!r} (static activation scales are not read)")
    if q.get("scale_fmt", "float") != "float":
        problems.append(f"scale_fmt={q.get('scale_fmt')!r} (only fp32 scales)")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        problems.append(f"weight_block_size={block!r} (expected two positive integers; per-tensor scales are not read)")
    if problems:
        raise UserError(f"{where}: unsupported quantization_config: {'; '.join(problems)}")
    return int(block[0]), int(block[1])


def without_quantization(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The config of the dequantised model: what convert and export write (bf16 weights)."""
    return {k: v for k, v in hf_config.items() if k != "quantization_config"}


def pair(infos: Mapping[str, TensorInfo], block: tuple[int, int] | None, where: str) -> dict[str, Quantized]:
    """The fp8 weights of `infos` with their scales (checked: shapes, dtypes, no fp8 tensor
    without a scale, no scale without its weight)."""
    scales = {k for k in infos if k.endswith(SCALE_SUFFIX)}
    fp8 = [k for k, v in infos.items() if v.dtype == FP8]
    if block is None:
        if fp8 or scales:
            raise UserError(
                f"{where}: has fp8 tensors or *{SCALE_SUFFIX} scales ({', '.join((fp8 or sorted(scales))[:3])}) "
                "but config.json has no fp8 quantization_config"
            )
        return {}
    out, bad = {}, []
    for k in fp8:
        w, s = infos[k], infos.get(k + SCALE_SUFFIX)
        if s is None:
            bad.append(f"{k} is fp8 without a {k + SCALE_SUFFIX}")
            continue
        want = tuple(ceil(n / b) for n, b in zip(w.shape, block))
        if len(w.shape) != 2 or s.shape != want or s.dtype != FLOAT32:
            bad.append(f"{s.name} is {list(s.shape)} {s.dtype} for weight {list(w.shape)}: expected {list(want)} fp32")
            continue
        out[k] = Quantized(w, s, block)
    bad += [
        f"{k} has no fp8 weight {k[: -len(SCALE_SUFFIX)]}" for k in sorted(scales) if k[: -len(SCALE_SUFFIX)] not in out
    ]
    if bad:
        raise UserError(f"{where}: inconsistent fp8 checkpoint:\n" + "\n".join(f"  - {b}" for b in bad[:8]))
    return out


def dequantized_infos(
    infos: Mapping[str, TensorInfo], quant: Mapping[str, Quantized]
) -> dict[str, tuple[tuple[int, ...], DType]]:
    """{name: (shape, dtype)} as the dequantised checkpoint has them (scales consumed)."""
    scales = {q.scale.name for q in quant.values()}
    return {k: (v.shape, BFLOAT16 if k in quant else v.dtype) for k, v in infos.items() if k not in scales}


def _tables(scale: float) -> tuple[bytes, bytes]:
    """Low and high bytes of bf16(fp32(v * scale)) for each fp8 byte v. Computed for the 128
    positive codes only: rounding to nearest even is symmetric, so a negative code's result
    is the positive one with the sign bit set (NaN, code 0xFF, excepted)."""
    f32 = array("f", [v * scale for v in E4M3[:128]])  # the double product is exact; one rounding to fp32
    bits = array("I")
    bits.frombytes(f32.tobytes())
    # NaN (only from the fp8 NaN codes 0x7F, 0xFF) comes out as 0xFFFF, as torch's CPU cast makes it
    half = [0xFFFF if (u & 0x7FFFFFFF) > 0x7F800000 else ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF for u in bits]
    lo = bytes(x & 0xFF for x in half)
    hi = bytes(x >> 8 for x in half)
    neg_hi = bytearray(h ^ 0x80 for h in hi)
    neg_hi[0x7F] = 0xFF if half[0x7F] == 0xFFFF else neg_hi[0x7F]
    return lo + lo, hi + bytes(neg_hi)


def dequant_rows(raw: bytes, cols: int, scales: array, first_block_row: int, block: tuple[int, int]) -> bytearray:
    """bf16 bytes (little-endian) of fp8 rows `raw` (rows x cols, C order) whose first row is
    the first row of block row `first_block_row`; `scales` is the whole fp32 scale grid."""
    bm, bn = block
    rows = len(raw) // cols if cols else 0
    nbc = ceil(cols / bn)
    bounds = [(j * bn, min((j + 1) * bn, cols)) for j in range(nbc)]
    lo: list[bytes] = []
    hi: list[bytes] = []
    put_lo, put_hi = lo.append, hi.append
    for r0 in range(0, rows, bm):
        br = first_block_row + r0 // bm
        tables = [(a, b, *_tables(scales[br * nbc + j])) for j, (a, b) in enumerate(bounds)]
        for base in range(r0 * cols, min(r0 + bm, rows) * cols, cols):
            for a, b, tl, th in tables:
                seg = raw[base + a : base + b]
                put_lo(seg.translate(tl))
                put_hi(seg.translate(th))
    out = bytearray(2 * len(raw))
    out[0::2] = b"".join(lo)
    out[1::2] = b"".join(hi)
    return out


_SCRATCH = threading.local()


def _scratch(name: str, nbytes: int) -> Any:
    """A uint8 numpy array of `nbytes`, this thread's own and reused across calls (grown when
    needed): a fresh 7 MiB index array per block row cost a page fault per 4 KiB — as much
    system time as the writes (300 k faults converting 1 G fp8 weights)."""
    import numpy as np

    have = getattr(_SCRATCH, name, None)
    if have is None or have.nbytes < nbytes:
        have = np.empty(nbytes, dtype=np.uint8)
        setattr(_SCRATCH, name, have)
    return have[:nbytes]


def _tables_numpy(scales: Any) -> Any:
    """(blocks, 256) uint16: bf16(fp32(v * s)) per fp8 byte v for each block scale s, with
    `_tables`' exact rules (one fp32 rounding, round-half-even to bf16, NaN -> 0xFFFF, a
    negative code is the positive result with the sign bit flipped, code 0xFF -> 0xFFFF)."""
    import numpy as np

    pos = np.asarray(E4M3[:128], dtype=np.float32)  # exact: e4m3 values are fp32 values
    with np.errstate(over="ignore", invalid="ignore"):
        u = (pos[None, :] * np.asarray(scales, dtype=np.float32)[:, None]).view(np.uint32)
    half = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    half[(u & 0x7FFFFFFF) > 0x7F800000] = 0xFFFF
    neg = half ^ np.uint16(0x8000)
    neg[:, 0x7F] = np.where(half[:, 0x7F] == 0xFFFF, 0xFFFF, neg[:, 0x7F])
    return np.concatenate([half, neg], axis=1)


def dequant_numpy(
    raw: Any, cols: int, scales: Any, first_block_row: int, block: tuple[int, int], out: Any = None
) -> Any:
    """`dequant_rows` with numpy (bit-identical): fp8 rows `raw` (bytes-like, rows x cols) ->
    bf16 as a (rows, cols) uint16 array (`out`, if given: written in place, no copy); one
    gather into the block row's tables per block row."""
    import numpy as np

    bm, bn = block
    if not cols:  # a 0-column tensor: no bytes, nothing to look up (reshape(-1, 0) is undefined)
        return np.empty((0, 0), dtype=np.uint16) if out is None else out
    w = np.frombuffer(raw, dtype=np.uint8).reshape(-1, cols)
    nbc = ceil(cols / bn)
    grid = np.asarray(scales, dtype=np.float32).reshape(-1, nbc)
    offset = (np.arange(cols, dtype=np.intp) // bn) * 256  # each column's block table
    out = np.empty(w.shape, dtype=np.uint16) if out is None else out
    idx = _scratch("idx", min(bm, w.shape[0]) * cols * 8).view(np.intp).reshape(-1, cols)  # reused (see _scratch)
    for r0 in range(0, w.shape[0], bm):
        table = _tables_numpy(grid[first_block_row + r0 // bm]).ravel()
        rows = w[r0 : r0 + bm]
        np.add(rows, offset, out=idx[: len(rows)])
        np.take(table, idx[: len(rows)], out=out[r0 : r0 + bm], mode="clip")  # clip: unbuffered
    return out


def read_scales(q: Quantized, files: OpenFiles) -> array:
    buf = bytearray(q.scale.nbytes)
    read_exactly(files(q.scale.file), memoryview(buf), q.scale.start, q.scale.file)
    out = array("f")
    out.frombytes(bytes(buf))
    return out


def dequantize(
    q: Quantized, files: OpenFiles, rows_per_read: int = 0, out: bytearray | mmap.mmap | None = None
) -> bytearray | memoryview:
    """The whole tensor as bf16 bytes, read one group of block rows at a time (`rows_per_read`,
    default: about 8 MiB of fp8), in place through a memory map (formats/mapped.py) — numpy,
    no torch. Into `out` (a reused buffer of at least
    2 × rows × cols bytes; fresh pages cost as much as the arithmetic) if given: then the
    returned view is its first 2 × rows × cols bytes."""
    import numpy as np

    rows, cols = q.shape
    if not rows or not cols:  # an empty tensor: no bf16 bytes (and no scale rows to read)
        return bytearray()
    bm = q.block[0]
    step = rows_per_read or max(bm, (8 * 2**20 // max(cols, 1)) // bm * bm)
    scales = read_scales(q, files)
    res: bytearray | memoryview = bytearray(2 * rows * cols) if out is None else memoryview(out)[: 2 * rows * cols]
    grid = np.frombuffer(res, dtype="<u2").reshape(rows, cols)
    for r0 in range(0, rows, step):
        n, at = min(step, rows - r0) * cols, q.weight.start + r0 * cols
        with mapped(files(q.weight.file), at, at + n, q.weight.file) as raw:  # read in place: no copy out
            dequant_numpy(raw, cols, scales, r0 // bm, q.block, out=grid[r0 : r0 + n // cols])
    return res


def dequant_torch(
    w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], first_block_row: int = 0
) -> torch.Tensor:
    """`dequant_rows` with torch: fp8 rows `w` (starting at block row `first_block_row`) times
    their block scales in fp32, rounded to bf16; in chunks of block rows (bounded temporaries)."""
    import torch

    bm, bn = block
    rows, cols = w.shape
    out = torch.empty((rows, cols), dtype=torch.bfloat16)
    step = max(bm, (16 * 2**20 // max(cols, 1)) // bm * bm)
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        b0 = first_block_row + r0 // bm
        s = scale[b0 : b0 + ceil((r1 - r0) / bm)].float()
        s = s.repeat_interleave(bm, dim=0)[: r1 - r0].repeat_interleave(bn, dim=1)[:, :cols]
        out[r0:r1] = (w[r0:r1].float() * s).to(torch.bfloat16)
    return out


def read_torch(q: Quantized, read_bytes: Any, r0: int = 0, r1: int | None = None) -> torch.Tensor:
    """Rows [r0, r1) of `q` dequantised with torch; `read_bytes(path, start, n)` -> uint8 tensor."""
    import torch

    rows, cols = q.shape
    r1 = rows if r1 is None else r1
    bm = q.block[0]
    a = r0 // bm * bm  # whole block rows are read, the extra rows dropped
    w = read_bytes(q.weight.file, q.weight.start + a * cols, (r1 - a) * cols).view(torch.float8_e4m3fn)
    s = read_bytes(q.scale.file, q.scale.start, q.scale.nbytes).view(torch.float32).reshape(q.scale.shape)
    return dequant_torch(w.reshape(r1 - a, cols), s.clone(), q.block, a // bm)[r0 - a :]


class Fp8Slice:
    """`safetensors_io.LazySlice` for an fp8 weight: `[a:b]` / `[a:b, c:d]` read the fp8 rows
    a..b (from the first row of their block) and the scales, and return the bf16 dequantisation
    (a column range is cut after dequantising its rows). What the live loader slices."""

    def __init__(self, q: Quantized, read_bytes: Any):
        self.q, self._read = q, read_bytes
        self.shape = q.shape

    @property
    def dtype(self) -> torch.dtype:
        return BFLOAT16.torch

    def __getitem__(self, idx: slice | tuple[slice, ...]) -> torch.Tensor:
        parts = idx if isinstance(idx, tuple) else (idx,)
        if not 1 <= len(parts) <= 2 or any(not isinstance(p, slice) or p.step not in (None, 1) for p in parts):
            raise TypeError(f"{self.q.weight.name}: only [a:b] and [a:b, c:d] slices are read lazily, got {idx!r}")
        r0, r1, _ = parts[0].indices(self.shape[0])
        t = read_torch(self.q, self._read, r0, max(r0, r1))
        return t[:, parts[1]].contiguous() if len(parts) == 2 else t

    def full(self) -> torch.Tensor:
        return read_torch(self.q, self._read)


def read_range(q: Quantized) -> list[tuple[Path, int, int]]:
    return [(q.weight.file, q.weight.start, q.weight.nbytes), (q.scale.file, q.scale.start, q.scale.nbytes)]


__all__ = [
    "FP8",
    "E4M3",
    "Quantized",
    "block_size",
    "without_quantization",
    "pair",
    "dequantized_infos",
    "dequant_rows",
    "dequant_numpy",
    "dequantize",
    "dequant_torch",
    "read_torch",
    "read_scales",
    "read_range",
    "Fp8Slice",
    "SCALE_SUFFIX",
]
