"""`run_torchrun`: per-rank results, failures with the ranks' output, and a hard timeout that
kills every process of the launch (a hung rank must fail the test, not hang CI)."""

import os
import time

import pytest

from megatron_bridge.fork_server import SERVER_ENV
from megatron_bridge.testing import TorchrunError

pytestmark = pytest.mark.dist


LAUNCHED_BY = {"torchrun": "torch.distributed.run", "fork": "megatron_bridge.fork_server"}


@pytest.fixture(params=["torchrun", "fork"])
def torchrun(request, torchrun):
    """tests/conftest.py's `torchrun` under both launchers: torchrun, and
    megatron_bridge.fork_launch from the session's fork server (tests/dist/conftest.py),
    once that has done its imports and listens."""
    if request.param == "fork":
        sock, deadline = os.environ[SERVER_ENV], time.monotonic() + 120
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.2)

    def run(args, nproc, **kwargs):
        return torchrun(args, nproc, launcher=request.param, **kwargs)

    run.launcher = request.param
    return run


PROBE = "tests/dist/scripts/harness_probe.py"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are dead
    except FileNotFoundError:
        return False


def test_collects_one_dict_per_rank_in_rank_order(torchrun):
    results = torchrun([PROBE, "report", "a", "b"], 3, timeout=120)
    launcher = LAUNCHED_BY[torchrun.launcher]
    assert results == [
        {"rank": r, "world": 3, "args": ["a", "b"], "second": True, "launcher": launcher} for r in range(3)
    ]


def test_nonzero_exit_raises_with_the_ranks_output(torchrun):
    with pytest.raises(TorchrunError) as err:
        torchrun([PROBE, "fail"], 2, timeout=120)
    assert err.value.returncode != 0
    assert "PROBE-FAILURE-MARKER" in err.value.output
    assert "PROBE-FAILURE-MARKER" in str(err.value)


def test_hung_ranks_fail_within_the_timeout_and_are_killed(torchrun, tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("checks process liveness through /proc")
    timeout = 20 if torchrun.launcher == "torchrun" else 10  # the fork server's ranks start at once
    start = time.monotonic()
    with pytest.raises(TorchrunError, match=f"timed out after {timeout} s"):
        torchrun([PROBE, "hang", str(tmp_path)], 2, timeout=timeout)
    elapsed = time.monotonic() - start
    assert timeout <= elapsed < timeout + 25  # the timeout, plus killing and reaping
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2  # both ranks had started and were hanging
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], "worker processes survived the timeout"
