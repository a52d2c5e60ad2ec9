"""tests/dist launch their ranks with `megatron_bridge.fork_launch` (forked after the imports:
the same processes, environment and gloo groups as under torchrun, without every rank
importing torch and megatron-core again — docs/contributing.md, "Test time"). A test module
that exercises torchrun itself says `LAUNCHER = "torchrun"`."""

import pytest

from megatron_bridge.testing import LAUNCHER_ENV


@pytest.fixture(scope="module", autouse=True)
def _launcher(request):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LAUNCHER_ENV, getattr(request.module, "LAUNCHER", "fork"))
        yield
