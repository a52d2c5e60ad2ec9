"""Shared fixtures. `torchrun` runs a multi-process job the way the dist tests need it."""

from pathlib import Path

import pytest

from megatron_bridge.testing import run_torchrun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def torchrun():
    """`torchrun(args, nproc, timeout=..., env=...)` -> per-rank result dicts: `run_torchrun`
    from the repository root, so script paths in tests are relative to it."""

    def run(args, nproc, **kwargs):
        kwargs.setdefault("cwd", str(ROOT))
        return run_torchrun(args, nproc, **kwargs)

    return run


@pytest.fixture(scope="module")
def groups1():
    """megatron-core's groups for one process (gloo), per test module, torn down and env
    restored after (`megatron_bridge.testing.one_process_groups`)."""
    from megatron_bridge.testing import one_process_groups

    with one_process_groups():
        yield
