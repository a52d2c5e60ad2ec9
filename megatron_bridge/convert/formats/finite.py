"""Non-finite values in stored tensor bytes, without torch: a float is NaN or infinite exactly
when its exponent bits are all ones, so one mask-and-compare over the bytes viewed as unsigned
integers decides it — bf16 and fp8 included, which numpy has no float type for.

`mbr convert` runs it on every source tensor as the bytes pass its CRC-32 reads (the byte path:
bytemove/checksums.py, bytemove/direct.py) or as tensors are built (sources/readers.py), so the
check costs no extra read (docs/benchmarks.md has the measurement).
"""

from __future__ import annotations

import threading
from typing import Any

from megatron_bridge.convert.formats.dtypes import DType

BLOCK = 2**18  # elements masked at a time, into one reused buffer per thread (cache-sized)
_local = threading.local()

# safetensors dtype -> (unsigned view, exponent mask): all exponent bits set = inf or NaN
_MASKS = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
    "F8_E5M2": ("u1", 0x7C),
    "F8_E4M3": ("u1", 0x7F),  # e4m3fn has no infinity; S.1111.111 is its NaN
}


def all_finite(dtype: DType, data: Any) -> bool:
    """Whether every value of `dtype` in the buffer `data` (whole elements) is finite."""
    mask = _MASKS.get(dtype.st)
    if mask is None or not len(data):
        return True
    import numpy as np  # on demand: only a conversion that reads values loads it

    a = np.frombuffer(data, dtype=mask[0])
    buf = getattr(_local, mask[0], None)
    if buf is None:  # a whole-array mask and compare would fault in two fresh arrays per call: 3.6x slower
        buf = np.empty(BLOCK, dtype=mask[0])
        setattr(_local, mask[0], buf)
    for i in range(0, len(a), BLOCK):
        part = a[i : i + BLOCK]
        out = buf[: len(part)]
        np.bitwise_and(part, mask[1], out=out)
        if out.max() == mask[1]:  # masked values are <= the mask: equal only with every exponent bit set
            return False
    return True


__all__ = ["all_finite"]
