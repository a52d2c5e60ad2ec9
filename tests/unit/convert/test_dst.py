"""`dst` of convert/export/reshard/data: the lease, what overwrite may replace, the sweep, SIGTERM, modes.

In-process and fast: the lease holder is a child process (`python -c`) holding the lock, so
the refusal is the real cross-process one; two real converts to one `dst` run once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_bridge.cli import main as mbr
from megatron_bridge.convert.pipeline.dst import check_replaceable, dst_lease, is_ours, lease_path
from megatron_bridge.convert.pipeline.run import atomic_output
from megatron_bridge.errors import UserError

ROOT = Path(__file__).resolve().parents[3]

HOLD = """
import sys, time
from pathlib import Path
from megatron_bridge.convert.pipeline.dst import dst_lease
with dst_lease(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from megatron_bridge.runtime.tiny import make_tiny

    return make_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


def _holder(dst: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(dst)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout is not None and p.stdout.readline().strip() == "held"
    return p


def test_lease_refuses_a_second_writer_naming_the_holder_and_dies_with_it(tmp_path):
    dst = tmp_path / "out"
    p = _holder(dst)
    try:
        with pytest.raises(UserError, match=rf"being written by another run \(host .*, pid {p.pid} "):
            with dst_lease(dst):
                pass
    finally:
        p.kill()
        p.wait()
    with lease_path(dst).open("a") as f:  # a stale holder longer than ours: none of it may remain
        f.write(" " * 500 + "}")
    with dst_lease(dst):  # a killed holder's lock is gone with it: taken at once
        assert json.loads(lease_path(dst).read_text())["pid"] == os.getpid()
    assert not lease_path(dst).exists()  # released: nothing left next to dst


def test_only_our_outputs_are_replaced(tmp_path):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("x")
    check_replaceable(tmp_path / "absent", overwrite=False)
    with pytest.raises(UserError, match="already exists"):
        check_replaceable(user, overwrite=False)
    with pytest.raises(UserError, match="not an output of mbr"):
        check_replaceable(user, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        check_replaceable(tmp_path / "file", overwrite=True)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "mbr_manifest.json").write_text("{}")
    assert is_ours(ours)
    check_replaceable(ours, overwrite=True)
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"written_by": "mbr export"}}))
    assert is_ours(exported)
    (exported / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))  # someone's HF model
    assert not is_ours(exported)


def test_interrupted_partials_are_swept_and_a_dir_created_meanwhile_survives(tmp_path):
    dst = tmp_path / "out"
    stale = tmp_path / ".out.partial-abc123"
    stale.mkdir()
    (stale / "big").write_bytes(b"0" * 100)
    other = tmp_path / ".other.partial-x"  # another dst's: not ours to sweep
    other.mkdir()
    with pytest.raises(UserError, match="not an output of mbr"):
        with atomic_output(dst, overwrite=True) as tmp:
            assert not stale.exists() and other.exists()
            (tmp / "w").write_text("new")
            dst.mkdir()  # a user makes a directory at dst while the run writes
            (dst / "keep").write_text("user's")
    assert (dst / "keep").read_text() == "user's" and not (dst / "w").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.partial-x", "out"]


def test_output_mode_honours_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_output(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755


def test_convert_refuses_to_overwrite_a_foreign_dir_and_dot(capsys, tmp_path, llama, monkeypatch):
    user = tmp_path / "mydir"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    monkeypatch.chdir(user)
    assert mbr(["convert", f"src={llama}", "dst=.", "overwrite=true", "progress=off"]) == 2
    assert "not an output of mbr" in capsys.readouterr().err
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    monkeypatch.chdir(tmp_path)
    assert mbr(["convert", f"src={llama}", "dst=a", "progress=off"]) == 0
    assert mbr(["convert", f"src={llama}", "dst=a", "overwrite=true", "progress=off"]) == 0  # ours: replaced
    assert mbr(["export", "src=a", "dst=h", "progress=off"]) == 0
    assert mbr(["export", "src=a", "dst=h", "overwrite=true", "progress=off"]) == 0
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    from megatron_bridge.convert.command import sigterm_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt(), atomic_output(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
    assert signal.getsignal(signal.SIGTERM) == before
    assert list(tmp_path.iterdir()) == []  # no output, no partial, no lease file


def test_two_converts_to_one_dst(tmp_path, llama):
    """Two real `mbr convert` processes to one dst: one result, the other refused naming the
    holder (or, if the first had finished, 'already exists')."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megatron_bridge.cli", "convert", f"src={llama}", "progress=off"]
    a = subprocess.Popen([*cmd, f"dst={tmp_path / 'o'}"], env=env, stderr=subprocess.PIPE, text=True)
    b = subprocess.Popen([*cmd, f"dst={tmp_path / 'o'}"], env=env, stderr=subprocess.PIPE, text=True)
    (_, ea), (_, eb) = a.communicate(timeout=120), b.communicate(timeout=120)
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 2], (ea, eb)
    err = eb if b.returncode else ea
    assert "being written by another run" in err or "already exists" in err, err
    assert "Traceback" not in err
    assert (tmp_path / "o" / "mbr_manifest.json").is_file()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
