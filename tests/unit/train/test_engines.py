"""The engine interface holds: every `train.engine` that `mbr check` accepts has an engine,
every engine is built and checkpointed the same way, and the runner never asks which engine
it holds. (tests/dist/test_train.py trains and resumes both engines for real.)"""

import ast
import inspect
from pathlib import Path

import pytest

from megatron_bridge.parallel.rules.degrees import CHOICES
from megatron_bridge.train.engines import ENGINES, Engine

PKG = Path(__file__).resolve().parents[3] / "megatron_bridge"


def test_every_accepted_engine_name_has_an_engine():
    assert set(ENGINES) == set(CHOICES["train.engine"])


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_engines_implement_the_whole_interface_with_one_constructor(name):
    cls = ENGINES[name]
    assert issubclass(cls, Engine) and not inspect.isabstract(cls), name
    assert inspect.signature(cls.__init__) == inspect.signature(Engine.__init__), name


@pytest.mark.parametrize("module", ["runner.py", "job.py"])
def test_runner_has_no_engine_branches(module):
    """No engine names, engine classes or attribute probes in the runner (the entry point and
    the job it runs): what differs between engines lives behind `Engine`."""
    tree = ast.parse((PKG / "train" / module).read_text())
    engine_classes = {cls.__name__ for cls in ENGINES.values()}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in ENGINES:
            found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.Name) and node.id in {"hasattr", "getattr", *engine_classes}:
            found.append(f"line {node.lineno}: {node.id}")
        if isinstance(node, ast.alias) and node.name in engine_classes:
            found.append(f"line {node.lineno}: import {node.name}")
    assert not found, found


def test_megatron_ddp_wrapping_exists_once():
    """One `DistributedDataParallel(...)` construction in the package (bridge.runtime.wrap_ddp):
    training and `mbr verify` wrap the model the same way."""
    calls = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "DistributedDataParallel":
                calls.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("runtime/schedule.py:"), calls


@pytest.mark.parametrize("fused", [False, True])
def test_deepspeed_optimizer_is_torch_adam_unless_fused_adam_is_built_in(fused):
    """DeepSpeed JIT-compiles FusedAdam when the wheel lacks it (nvcc, minutes; it failed on an
    H200): the config asks for torch's Adam unless the engine found the op built in."""
    from megatron_bridge.config.compose import compose
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.train.ds_config import build_ds_config

    cfg, _ = compose(["recipe=tiny_llama", "train.engine=deepspeed", "zero.stage=2", "parallel.tp=1", "parallel.pp=1"])
    dims = ParallelDims.from_config(cfg, 2, moe=False)
    params = build_ds_config(cfg, dims, bf16=False, fused_adam=fused)["optimizer"]["params"]
    assert params["torch_adam"] is (not fused)
