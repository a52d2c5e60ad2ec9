"""tests/dist launch their ranks with `megatron_bridge.fork_launch` (forked after the imports:
the same processes, environment and gloo groups as under torchrun, without every rank
importing torch and megatron-core again — docs/contributing.md, "Test time"), from one
`megatron_bridge.fork_server` per session (the imports done once for all launches; a launch
made before it is ready, or after it is gone, starts its own fork_launch). A test module
that exercises torchrun itself says `LAUNCHER = "torchrun"`."""

import os
import subprocess
import sys
import tempfile

import pytest

from megatron_bridge.fork_server import SERVER_ENV
from megatron_bridge.testing import LAUNCHER_ENV, launch_env


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
                [sys.executable, "-m", "megatron_bridge.fork_server", sock], stdout=log, stderr=subprocess.STDOUT, env=env
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
