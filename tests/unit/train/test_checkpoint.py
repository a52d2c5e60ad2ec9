"""Checkpoint writes are atomic and verified (single process; tests/dist covers ranks)."""

import json

import pytest
import torch

from megatron_bridge.errors import UserError
from megatron_bridge.train import checkpoint as ckpt
from megatron_bridge.train import manifest


def test_save_load_roundtrip_and_latest_pointer(tmp_path):
    s1 = {"w": torch.arange(4.0), "step": 1}
    ckpt.save(tmp_path, 1, s1, {"layout": "tp1"})
    ckpt.save(tmp_path, 2, {"w": torch.ones(3), "step": 2}, {"layout": "tp1"})
    assert manifest.latest_iteration(tmp_path) == 2
    it, state = ckpt.load(tmp_path, {"layout": "tp1"})
    assert it == 2 and state["step"] == 2 and torch.equal(state["w"], torch.ones(3))
    m = json.loads((manifest.iter_dir(tmp_path, 2) / manifest.MANIFEST).read_text())
    assert m["iteration"] == 2 and len(m["files"]) == 1 and len(m["files"][0]["sha256"]) == 64


def test_torn_save_is_ignored(tmp_path):
    ckpt.save(tmp_path, 5, {"a": 1}, {})
    torn = manifest.iter_dir(tmp_path, 6).with_suffix(".tmp")  # what a kill during save leaves
    torn.mkdir()
    (torn / "rank_00000.pt.partial").write_bytes(b"garbage")
    assert ckpt.load(tmp_path, {})[0] == 5
    ckpt.save(tmp_path, 7, {"a": 2}, {})
    assert not torn.exists()  # cleaned by the next save


def test_corruption_named(tmp_path):
    d = ckpt.save(tmp_path, 3, {"a": torch.zeros(10)}, {})
    f = d / "rank_00000.pt"
    f.write_bytes(f.read_bytes()[:-5] + b"xxxxx")
    with pytest.raises(UserError, match="rank_00000.pt \\(checksum mismatch\\)"):
        ckpt.load(tmp_path, {})
    f.unlink()
    with pytest.raises(UserError, match="missing"):
        manifest.verify(d)


def test_layout_mismatch_refused(tmp_path):
    ckpt.save(tmp_path, 1, {}, {"layout": "tp2·pp2"})
    with pytest.raises(UserError, match="different setup.*layout: checkpoint tp2·pp2 vs now tp1"):
        ckpt.load(tmp_path, {"layout": "tp1"})


def test_no_checkpoint(tmp_path):
    assert ckpt.load(tmp_path, {}) == (None, None)


def test_background_save_publishes_only_when_finished(tmp_path, monkeypatch):
    """checkpoint.async_save: the state is copied to host at `start` (later in-place changes to
    the live tensors do not reach the file, which the thread serialises afterwards); nothing is
    published (`latest` stays on the previous checkpoint) until `finish`."""
    import threading

    ckpt.save(tmp_path, 2, {"w": torch.zeros(3)}, {"layout": "tp1"})
    gate, real = threading.Event(), ckpt.write_state

    def slow_write(path, state):
        assert gate.wait(30)
        return real(path, state)

    monkeypatch.setattr(ckpt, "write_state", slow_write)
    w, buf = torch.ones(3), torch.arange(8.0)
    pending = ckpt.start(tmp_path, 4, {"w": w, "view": buf[2:4], "rng": [(w, 1)]}, {"layout": "tp1"}, background=True)
    w.add_(1)  # training goes on (before the thread serialises anything): the snapshot holds ones
    buf.zero_()
    assert not pending.written_everywhere() and manifest.latest_iteration(tmp_path) == 2
    gate.set()
    assert pending.finish() == manifest.iter_dir(tmp_path, 4)
    assert pending.written_everywhere() and manifest.latest_iteration(tmp_path) == 4
    it, state = ckpt.load(tmp_path, {"layout": "tp1"})
    assert it == 4 and torch.equal(state["w"], torch.ones(3)) and torch.equal(state["rng"][0][0], torch.ones(3))
    assert torch.equal(state["view"], torch.tensor([2.0, 3.0]))  # a view is saved as its own values


def test_rank_file_checksum_is_the_files(tmp_path):
    """The rank file is streamed into its file while hashed: the manifest's sha256 and size are
    the file's (what `mbr check-ckpt` and the loader verify)."""
    import hashlib

    d = ckpt.save(tmp_path, 1, {"w": torch.randn(1000), "n": 3}, {})
    entry = json.loads((d / manifest.MANIFEST).read_text())["files"][0]
    data = (d / "rank_00000.pt").read_bytes()
    assert entry == {"file": "rank_00000.pt", "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest.verify(d)


def test_background_write_failure_publishes_nothing(tmp_path, monkeypatch):
    """A background write that fails (disk full) makes `finish` raise the disk-full message (the
    other ranks: naming this one); `latest` stays on the last complete checkpoint."""
    ckpt.save(tmp_path, 2, {"w": torch.zeros(3)}, {})

    def full(path, state):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_state", full)
    pending = ckpt.start(tmp_path, 4, {"w": torch.ones(3)}, {}, background=True)
    with pytest.raises(UserError, match=r"disk full while saving the checkpoint of iteration 4"):
        pending.finish()
    assert manifest.latest_iteration(tmp_path) == 2 and not manifest.iter_dir(tmp_path, 4).exists()
    assert ckpt.load(tmp_path, {})[0] == 2


def test_disk_full_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    ckpt.save(tmp_path, 2, {"w": torch.ones(3)}, {})
    real = ckpt.write_state

    def full(path, state):  # the filesystem fills up after half of the rank file
        real(path, state)
        data = path.read_bytes()
        path.unlink()
        path.with_name(path.name + ".partial").write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt, "write_state", full)
    with pytest.raises(UserError, match=r"disk full while saving the checkpoint of iteration 4 to .*iter_0000004\.tmp"):
        ckpt.save(tmp_path, 4, {"w": torch.zeros(3)}, {})
    monkeypatch.setattr(ckpt, "write_state", real)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", manifest.LATEST]  # nothing half-written
    it, state = ckpt.load(tmp_path, {})
    assert it == 2 and torch.equal(state["w"], torch.ones(3))


def test_background_saves_reuse_the_staging_buffers(tmp_path):
    """checkpoint.async_save with `HostStaging`: the second save's snapshot goes into the first
    one's host buffers (same memory; on a GPU pinned ones), once the first write is published;
    each file holds its own step's values; a place whose shape changes gets a new buffer."""
    from megatron_bridge.train.host_staging import HostStaging

    staging = HostStaging()
    w, b = torch.ones(4), torch.zeros(2, dtype=torch.bfloat16)
    first = ckpt.start(tmp_path, 1, {"w": w, "opt": [{"b": b}], "n": 1}, {}, background=True, staging=staging)
    first.finish()
    ptrs = {k: t.data_ptr() for k, t in staging._buffers.items()}
    assert set(ptrs) == {("w",), ("opt", 0, "b")} and staging.nbytes == 4 * 4 + 2 * 2
    w.add_(1)
    second = ckpt.start(tmp_path, 2, {"w": w, "opt": [{"b": torch.ones(3, dtype=torch.bfloat16)}], "n": 2}, {},
                        background=True, staging=staging)  # fmt: skip
    w.add_(1)  # after the snapshot: not in the file
    second.finish()
    assert staging._buffers[("w",)].data_ptr() == ptrs[("w",)]  # reused
    assert staging._buffers[("opt", 0, "b")].shape == (3,)  # re-allocated for the new shape
    assert torch.equal(torch_load_rank(tmp_path, 1)["w"], torch.ones(4))
    state = torch_load_rank(tmp_path, 2)
    assert torch.equal(state["w"], torch.full((4,), 2.0)) and state["n"] == 2
    assert torch.equal(state["opt"][0]["b"], torch.ones(3, dtype=torch.bfloat16))


def torch_load_rank(root, iteration):
    return torch.load(manifest.iter_dir(root, iteration) / "rank_00000.pt", weights_only=True)
