"""tests/dist launch their ranks with `megatron_bridge.fork_launch` (forked after the imports:
the same processes, environment and gloo groups as under torchrun, without every rank
importing torch and megatron-core again — docs/contributing.md, "Test time"), from one
`megatron_bridge.fork_server` per session (the imports done once for all launches; a launch
made before it is ready, or after it is gone, starts its own fork_launch). A test module
that exercises torchrun itself says `LAUNCHER = "torchrun"`.

`FIRST` runs ahead of the other modules: those that leave a core idle part of the time (their
pytest process building references alone, 2-rank launches, pip building a wheel), so that
scripts/test.sh's unit tests beside them fill it; the modules that keep both cores busy run
after the unit tests end. Measured per module: docs/contributing.md, "Test time"."""

import os
import subprocess
import sys
import tempfile

import pytest

from megatron_bridge.fork_server import SERVER_ENV
from megatron_bridge.testing import LAUNCHER_ENV, launch_env


FIRST = [
    "test_train.py",
    "test_wheel_install.py",
    "test_train_families.py",
    "test_lora_parity.py",
    "test_harness.py",
    "test_sft_parity.py",
    "test_lora_train.py",
    "test_launch_multinode.py",
]


def pytest_collection_modifyitems(session, config, items):
    """The modules of FIRST first, in its order; everything else after, in pytest's order."""

    def rank(pair):
        position, item = pair
        name = item.path.name
        first = item.path.parent.name == "dist" and name in FIRST
        return (0, FIRST.index(name), position) if first else (1, 0, position)

    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


@pytest.fixture(scope="session", autouse=True)
def _fork_server():
    if os.environ.get(SERVER_ENV):  # one already serves this session (or a caller's)
        yield
        return
    with tempfile.TemporaryDirectory(prefix="mbr-fork-server-") as d:
        sock = os.path.join(d, "socket")
        env = launch_env()  # what run_torchrun gives a launch, so the server's imports see the same
        with open(os.path.join(d, "server.log"), "wb") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "megatron_bridge.fork_server", sock],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(SERVER_ENV, sock)
            try:
                yield
            finally:
                server.terminate()
                server.wait(timeout=30)


@pytest.fixture(scope="module", autouse=True)
def _launcher(request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCHER_ENV, getattr(request.module, "LAUNCHER", "fork"))
        yield
