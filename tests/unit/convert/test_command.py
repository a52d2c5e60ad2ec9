"""The conversion commands' start-up (`convert/command.py`): the recipe composed in a forked
child while the parent imports the pipeline gives what composing in-process gives, and a
child that fails leaves the error to the parent's own compose."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_bridge.convert import command
from megatron_bridge.convert.pipeline import schemas

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="compose_beside forks")


@pytest.fixture
def forking(monkeypatch):
    """Under pytest, stdout is captured, so the command would compose in-process: allow the fork."""
    monkeypatch.setattr(command, "_may_fork", lambda: True)


def test_child_composes_what_the_parent_would(forking):
    argv = ["src=/some/hf", "dst=/out", "parallel.tp=2", "format=torch", "workers=3", "--cfg", "job"]
    got = command.compose_beside(argv, "ConvertConfig", None)()
    assert got is not None
    assert got == command._compose(argv, schemas.ConvertConfig, None)
    cfg, print_cfg = got
    assert isinstance(cfg, schemas.ConvertConfig) and cfg.parallel.tp == 2 and cfg.workers == 3 and print_cfg == "job"


@pytest.mark.parametrize("argv", [["src=/a", "dst=/b", "parallel.tpx=2"], ["--help"], ["src=/a", "workers=many"]])
def test_a_failing_child_leaves_the_error_to_the_parent(forking, argv):
    assert command.compose_beside(argv, "ConvertConfig", "doc")() is None  # and no child is left behind
    with pytest.raises(Exception) as err:
        command._compose(argv, schemas.ConvertConfig, "doc")
    assert type(err.value).__name__ in ("UserError", "HelpRequested")


def test_no_fork_beside_other_threads_or_torch_or_captured_output():
    assert not command._may_fork()  # pytest captures stdout here
    done = threading.Event()
    t = threading.Thread(target=done.wait)
    t.start()
    try:
        assert threading.active_count() > 1 and command.compose_beside(["src=/a"], "ConvertConfig", None)() is None
    finally:
        done.set()
        t.join()


# `mbr convert ...` as the console script runs it, counting the forks on the way
CLI = """
import os, sys
forks, fork = [], os.fork
os.fork = lambda: forks.append(1) or fork()
from megatron_bridge.cli import main
code = main(sys.argv[1:])
print(f"forks={len(forks)}", file=sys.stderr)
sys.exit(code)
"""


def test_cli_composes_beside_and_reports_errors_once(tmp_path):
    """The real CLI (stdout its own, no threads): `--cfg job` prints the recipe the child
    composed, and a bad override is one `error:` paragraph, exit 2, written once (by the parent,
    composing again after the child failed)."""
    beside = int(len(os.sched_getaffinity(0)) >= 2)
    mbr = [sys.executable, "-c", CLI, "convert", "src=/x", f"dst={tmp_path}/o"]
    ok = subprocess.run([*mbr, "parallel.tp=2", "--cfg", "job"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0 and f"forks={beside}" in ok.stderr, ok.stderr
    assert "tp: 2" in ok.stdout and "src: /x" in ok.stdout
    bad = subprocess.run([*mbr, "parallel.tpx=2"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and f"forks={beside}" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.count("error:") == 1 and "Key 'tpx' not in 'ParallelConfig'" in bad.stderr
    assert not (tmp_path / "o").exists()
