"""The converter's I/O helpers: recycled read buffers (`BufferPool`) and early write-out
(`Writeback`). Both are speed measures (docs/benchmarks.md, "Conversion"); what is tested
here is that they never change a byte: a pooled buffer is handed out again only when no
tensor still uses it, and full round trips with every read going through the pool stay
bit-exact."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_bridge.convert.formats.safetensors_io import BufferPool
from megatron_bridge.convert.pipeline.writeback import Writeback, _sync_file_range

MB = 2**20


def test_pool_reuses_a_buffer_only_after_every_view_is_gone():
    pool = BufferPool(cap=64 * MB)
    a = pool.take(8 * MB)
    a.fill_(7)
    first = a.data_ptr()
    view = a.view(torch.int16).reshape(2, -1)  # a derived tensor keeps the buffer in use
    del a
    b = pool.take(8 * MB)
    assert b.data_ptr() != first
    b.fill_(1)
    assert int(view.view(torch.uint8).unique().item()) == 7  # untouched by the second read
    del view
    c = pool.take(6 * MB)  # fits the free 8 MiB buffer (<= 2x the request)
    assert c.data_ptr() == first and c.numel() == 6 * MB
    assert c.untyped_storage().nbytes() == 6 * MB  # the tensor owns exactly its bytes


def test_pool_respects_its_cap_and_skips_small_or_huge_reads():
    pool = BufferPool(cap=32 * MB)
    held = [pool.take(10 * MB) for _ in range(5)]  # 3 fit the cap, 2 are plain allocations
    assert sum(b.nbytes for b in pool._bufs) <= 32 * MB
    assert len({t.data_ptr() for t in held}) == 5
    small = pool.take(BufferPool.MIN_BYTES - 1)
    huge = pool.take(33 * MB)
    assert len(pool._bufs) == 3 and small.numel() == BufferPool.MIN_BYTES - 1 and huge.numel() == 33 * MB
    del held
    pool.take(20 * MB)  # needs room: free buffers are dropped until it fits
    assert sum(b.nbytes for b in pool._bufs) <= 32 * MB


def test_round_trips_with_every_read_pooled_are_bit_exact(tmp_path, monkeypatch):
    from test_convert_roundtrip import assert_same, hf_tensors, run

    from megatron_bridge.runtime.tiny import make_tiny

    monkeypatch.setattr(BufferPool, "MIN_BYTES", 0)  # tiny tensors too: reuse happens constantly
    src = make_tiny("llama", tmp_path / "hf")
    for fmt, layout in (("torch", ["parallel.tp=2", "parallel.pp=2"]), ("torch_dist", [])):
        run("convert", f"src={src}", f"dst={tmp_path / fmt}", f"format={fmt}", *layout)
        run("export", f"src={tmp_path / fmt}", f"dst={tmp_path / (fmt + '-hf')}")
        assert_same(hf_tensors(src), hf_tensors(tmp_path / (fmt + "-hf")))
    run("reshard", f"src={tmp_path / 'torch'}", f"dst={tmp_path / 't14'}", "parallel.tp=1", "parallel.pp=4")
    run("export", f"src={tmp_path / 't14'}", f"dst={tmp_path / 't14-hf'}")
    assert_same(hf_tensors(src), hf_tensors(tmp_path / "t14-hf"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux-only")
def test_writeback_starts_write_out_of_the_files_it_is_told_about(tmp_path):
    assert _sync_file_range() is not None  # found in libc on Linux; elsewhere Writeback does nothing
    wb = Writeback(kick_bytes=MB)
    paths = [tmp_path / "a", tmp_path / "b"]
    data = os.urandom(3 * MB)
    for p in paths:
        p.write_bytes(data)
        wb.wrote((p,), len(data))
    settle = lambda: wb._thread.submit(lambda: None).result()  # noqa: E731 - the kick thread's queue drained
    settle()
    assert set(wb._fds) == set(paths) and not wb._dirty  # each crossed the threshold: kicked
    wb.wrote((tmp_path / "not-created-yet",), 2 * MB)  # a file not on disk (yet) is skipped, no error
    settle()
    assert tmp_path / "not-created-yet" not in wb._fds
    wb.forget(paths[0])
    settle()
    assert paths[0] not in wb._fds
    small, calls = Writeback(kick_bytes=MB), []
    small._fn = lambda *a: calls.append(a) or 0
    small.wrote((paths[1],), MB // 2)
    small.forget(paths[1])
    small.close()  # under KICK_BYTES in all: never kicked
    assert calls == []
    wb.close()
    assert not wb._fds and all(p.read_bytes() == data for p in paths)


def test_every_writer_reports_what_it_writes_on_both_paths(tmp_path, monkeypatch):
    """Every output file's bytes reach `Writeback.wrote` (export's byte path once never told it,
    and its whole output waited for the final sync), on the byte path and the tensor path."""
    from test_convert_roundtrip import run

    from megatron_bridge.convert.bytemove import direct
    from megatron_bridge.convert.pipeline import writers
    from megatron_bridge.runtime.tiny import make_tiny

    told: dict[str, int] = {}

    class Recording(Writeback):
        def wrote(self, paths, nbytes):
            for p in paths:
                parts = p.parts[next(i for i, x in enumerate(p.parts) if ".partial-" in x) + 1 :]
                key = "/".join(parts)  # in the output being written, before it is published
                told[key] = told.get(key, 0) + nbytes / len(paths)
            super().wrote(paths, nbytes)

    monkeypatch.setattr(writers, "Writeback", Recording)
    src = make_tiny("llama", tmp_path / "hf")
    weights = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    for on in (True, False):
        monkeypatch.setattr(direct, "ENABLED", on)
        for name, args in (
            ("dist", ["format=torch_dist"]),
            ("t22", ["format=torch", "parallel.tp=2", "parallel.pp=2"]),
        ):
            told.clear()
            run("convert", f"src={src}", f"dst={tmp_path / f'{name}{on}'}", *args)
            out = tmp_path / f"{name}{on}"
            outputs = {str(p.relative_to(out)) for p in [*out.rglob("*.distcp"), *out.rglob("model_optim_rng.pt")]}
            assert outputs and set(told) >= outputs, (on, name, sorted(outputs - set(told)))
            assert weights * 0.9 < sum(told.values()) < weights * 1.1, (on, name)  # the tensors, once
            told.clear()
            run(
                "export", f"src={tmp_path / f'{name}{on}'}", f"dst={tmp_path / f'{name}{on}-hf'}", "max_shard_gb=0.0002"
            )
            outputs = {p.name for p in (tmp_path / f"{name}{on}-hf").glob("*.safetensors")}
            assert len(outputs) > 1 and set(told) == outputs, (on, name, sorted(outputs ^ set(told)))
            assert weights * 0.9 < sum(told.values()) < weights * 1.1, (on, name)
