"""`mbr convert`'s byte-level non-finite check (convert/formats/finite.py), every float dtype."""

import math

import pytest
import torch

from megatron_bridge.convert.formats.dtypes import BY_NAME
from megatron_bridge.convert.formats.finite import all_finite


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16", "float64", "float8_e4m3fn"])
def test_byte_level_check_finds_nan_and_inf_in_every_float_dtype(name):
    dtype = getattr(torch, name)
    t = (torch.randn(1000) * 10).to(dtype)
    raw = lambda x: x.view(torch.uint8).numpy().tobytes()  # noqa: E731
    assert all_finite(BY_NAME[name], raw(t))
    for bad in [math.nan] + ([] if name == "float8_e4m3fn" else [math.inf, -math.inf]):
        u = t.clone()
        u[517] = bad
        assert not all_finite(BY_NAME[name], raw(u)), (name, bad)


def test_a_bad_value_past_the_first_block_is_found(monkeypatch):
    """The check masks a block at a time into a reused buffer: every block is looked at."""
    from megatron_bridge.convert.formats import finite

    monkeypatch.setattr(finite, "BLOCK", 1000)
    t = torch.randn(5500).to(torch.bfloat16)
    for at in (0, 999, 1000, 5499):
        u = t.clone()
        u[at] = math.inf
        assert not all_finite(BY_NAME["bfloat16"], u.view(torch.uint8).numpy().tobytes()), at
    assert all_finite(BY_NAME["bfloat16"], t.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("threads", [1, 3])
def test_checksums_on_threads_give_every_crc_and_every_bad_tensor(tmp_path, monkeypatch, threads):
    """bytemove.Checksums: CRC-32 and the finite check of each tensor, in views of EACH_BYTES
    (a bad value in any view is found), on one thread or several; an error is re-raised."""
    import zlib

    from megatron_bridge.convert.bytemove.checksums import Checksums
    from megatron_bridge.convert.formats import mapped
    from megatron_bridge.convert.formats.safetensors_io import TensorInfo
    from megatron_bridge.errors import UserError

    monkeypatch.setattr(mapped, "EACH_BYTES", 4096)
    path, blob, infos = tmp_path / "blob", b"", []
    for i in range(8):
        t = torch.randn(3000 + 500 * i).to(torch.bfloat16)
        if i in (2, 5):
            t[-1] = math.nan  # in the last of several views
        data = t.view(torch.uint8).numpy().tobytes()
        infos.append(TensorInfo(f"t{i}", BY_NAME["bfloat16"], tuple(t.shape), path, len(blob), len(blob) + len(data)))
        blob += data
    path.write_bytes(blob)
    c = Checksums(check_finite=True, threads=threads)
    for info in infos:
        c.add(info)
    got = c.result()
    assert got == {i.name: f"{zlib.crc32(blob[i.start : i.end]):08x}" for i in infos}
    assert c.nonfinite == {"t2", "t5"}
    broken = Checksums(threads=threads)
    broken.add(TensorInfo("past-the-end", BY_NAME["bfloat16"], (10,), path, len(blob), len(blob) + 20))
    with pytest.raises(UserError, match="truncated"):
        broken.result()
