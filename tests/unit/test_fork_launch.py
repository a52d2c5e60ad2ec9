"""megatron_bridge.fork_launch outside a launch: its command line is torchrun's, each rank gets
torchrun's environment, and it never forks a process that runs a second thread (it becomes
torchrun instead). The launches themselves run in tests/dist (test_harness.py runs every
harness check under both launchers; the other tests/dist launches use it)."""

import threading

import pytest

from megatron_bridge import fork_launch
from megatron_bridge.testing import torchrun_cmd


def test_takes_the_harness_torchrun_command_line():
    cmd = torchrun_cmd(3, "script.py", "a", "--flag", launcher="fork")
    assert cmd[1:3] == ["-m", "megatron_bridge.fork_launch"]
    a = fork_launch._parse(cmd[3:])
    assert (a.nproc_per_node, a.master_addr, a.module, a.target, a.args) == (
        3,
        "127.0.0.1",
        False,
        "script.py",
        ["a", "--flag"],
    )
    m = fork_launch._parse(["--nproc-per-node", "2", "--master-port", "1", "-m", "pkg.mod", "x=1"])
    assert (m.module, m.target, m.args) == (True, "pkg.mod", ["x=1"])


def test_refuses_restarts():
    with pytest.raises(SystemExit):
        fork_launch._parse(["--nproc-per-node", "2", "--master-port", "1", "--max-restarts", "3", "s.py"])


def test_each_rank_gets_torchruns_environment():
    a = fork_launch._parse(["--nproc-per-node", "4", "--master-port", "29999", "s.py"])
    env = fork_launch._rank_env(a, 2, "abc")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")} == {
        "RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0",
    }  # fmt: skip
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) == ("127.0.0.1", "29999", "abc")


def test_a_second_thread_means_torchrun_not_fork(monkeypatch):
    execs = []

    class Exec(Exception):
        pass

    def fake_execv(path, argv):
        execs.append(argv)
        raise Exec

    monkeypatch.setattr(fork_launch, "PRELOAD", ())
    monkeypatch.setattr(fork_launch.os, "execv", fake_execv)
    monkeypatch.setattr(fork_launch.os, "fork", lambda: pytest.fail("forked beside a second thread"))
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        with pytest.raises(Exec):
            fork_launch.main(["--nproc-per-node", "2", "--master-port", "1", "s.py", "x"])
    finally:
        stop.set()
        t.join()
    assert execs[0][1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "1", "s.py", "x"]


def test_fork_server_launches_reports_exit_codes_and_falls_back(tmp_path, monkeypatch):
    """megatron_bridge.fork_server (here without its imports, PRELOAD empty): run_torchrun's
    fork launches go through it — the ranks' parent is the launcher it forked, a failing rank's
    exit code comes back — and without a server listening, a launch starts its own process."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from megatron_bridge import testing
    from megatron_bridge.fork_server import SERVER_ENV
    from megatron_bridge.testing import TorchrunError, run_torchrun

    root, sock = Path(__file__).resolve().parents[2], str(tmp_path / "socket")
    code = "import sys; from megatron_bridge import fork_launch, fork_server; fork_launch.PRELOAD = (); "
    code += "fork_server.serve(sys.argv[1])"
    server = subprocess.Popen([sys.executable, "-c", code, sock], cwd=root)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setenv(SERVER_ENV, sock)
        probe = "tests/dist/scripts/harness_probe.py"
        results = run_torchrun([probe, "report", "x"], 2, launcher="fork", cwd=str(root), timeout=60)
        assert [r["rank"] for r in results] == [0, 1] and results[0]["args"] == ["x"]
        assert {r["launcher"] for r in results} == {code}  # forked from the server (python -c CODE)
        atexit_probe = tmp_path / "atexit_probe.py"  # a rank ends as its own process would: atexit runs
        atexit_probe.write_text(
            "import atexit, os, sys\n"
            "atexit.register(lambda: open(os.path.join(sys.argv[1], os.environ['RANK']), 'w').close())\n"
            "sys.exit(0)\n"
        )
        run_torchrun([str(atexit_probe), str(tmp_path)], 2, launcher="fork", timeout=60, expect_results=False)
        assert (tmp_path / "0").exists() and (tmp_path / "1").exists()
        with pytest.raises(TorchrunError) as err:
            run_torchrun([probe, "fail"], 2, launcher="fork", cwd=str(root), timeout=60)
        assert err.value.returncode == 1 and "PROBE-FAILURE-MARKER" in err.value.output
    finally:
        server.terminate()
        server.wait(timeout=10)
    with open(tmp_path / "log", "wb") as log:  # no server listening: the launch starts its own process
        assert testing._forked(["s.py"], {SERVER_ENV: sock}, None, log.fileno()) is None
