"""File ranges read through memory-mapped windows (convert/formats/mapped.py): CRC-32s and views."""

from __future__ import annotations

import mmap
import os
import zlib

import pytest

from megatron_bridge.convert.formats import mapped as mapped_mod
from megatron_bridge.convert.formats.mapped import crc32_file, crc32_range, mapped
from megatron_bridge.errors import UserError


@pytest.fixture
def blob(tmp_path):
    data = os.urandom(5 * mmap.ALLOCATIONGRANULARITY + 1234)
    path = tmp_path / "blob"
    path.write_bytes(data)
    return path, data


G = mmap.ALLOCATIONGRANULARITY


@pytest.mark.parametrize("window, each", [(G, mapped_mod.EACH_BYTES), (3 * G, G), (mapped_mod.WINDOW, 2 * G)])
def test_any_range_and_window_gives_zlibs_crc(blob, monkeypatch, window, each):
    path, data = blob
    monkeypatch.setattr(mapped_mod, "WINDOW", window)
    monkeypatch.setattr(mapped_mod, "EACH_BYTES", each)
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in [(0, len(data)), (1, len(data) - 1), (4095, 4097), (777, 3 * 4096 + 5), (10, 10)]:
            chunks: list[bytes] = []
            got = crc32_range(fd, start, end, path, each=lambda v, c=chunks: c.append(bytes(v)))
            assert got == zlib.crc32(data[start:end]), (start, end)
            assert b"".join(chunks) == data[start:end]  # `each` sees every byte once, in order
            assert all(len(c) == min(window, each) for c in chunks[:-1])  # whole views from `start`
            assert crc32_range(fd, end, len(data), path, value=got) == zlib.crc32(data[start:])  # continues
    finally:
        os.close(fd)
    assert crc32_file(path) == zlib.crc32(data)


def test_a_file_that_cannot_be_mapped_is_read(blob, monkeypatch):
    path, data = blob

    def refuse(*a, **k):
        raise OSError(19, "No such device")  # what mmap gives on filesystems without it

    monkeypatch.setattr(mapped_mod.mmap, "mmap", refuse)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert crc32_range(fd, 3, len(data) - 2, path) == zlib.crc32(data[3:-2])
    finally:
        os.close(fd)


def test_a_range_past_the_end_is_a_truncated_file(blob):
    path, data = blob
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(UserError, match="truncated"):
            crc32_range(fd, 0, len(data) + 1, path)
    finally:
        os.close(fd)


def test_mapped_gives_the_bytes_mapped_or_read(blob, monkeypatch):
    path, data = blob
    fd = os.open(path, os.O_RDONLY)
    try:
        with mapped(fd, 4097, 3 * 4096 + 11, path) as view:
            assert bytes(view) == data[4097 : 3 * 4096 + 11]
        with mapped(fd, 5, 5, path) as view:
            assert len(view) == 0
        monkeypatch.setattr(mapped_mod.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(19, "no")))
        with mapped(fd, 1, 99, path) as view:
            assert bytes(view) == data[1:99]
        with pytest.raises(UserError, match="truncated"):
            with mapped(fd, 0, len(data) + 1, path):
                pass
    finally:
        os.close(fd)
