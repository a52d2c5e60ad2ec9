"""The CPU shim's contract with megatron-core (megatron_bridge/runtime/cpu_targets.py).

The shim patches megatron-core internals; these tests fail when an upgrade moves one of
them, instead of a CPU run failing (or silently computing something else) later."""

from __future__ import annotations

import importlib.metadata
import inspect

import pytest
import torch

from megatron_bridge.runtime import cpu_targets
from megatron_bridge.runtime.cpu_targets import CUDA_VIEW, PATCH_TARGETS, WRITTEN_FOR, missing_targets, resolve


@pytest.mark.parametrize("target", PATCH_TARGETS)
def test_every_patch_target_exists_in_the_installed_megatron_core(target):
    owner, name = resolve(target)
    if name:
        value = inspect.getattr_static(owner, name)
        assert callable(getattr(owner, name)) or isinstance(value, (staticmethod, classmethod)), target


def test_cuda_view_targets_are_functions_or_methods_of_classes():
    """install() wraps a class's method in place, or rebinds a module function everywhere."""
    for target in CUDA_VIEW:
        owner, name = resolve(target)
        assert inspect.isclass(owner) or inspect.isfunction(getattr(owner, name)), target


def test_installed_megatron_core_is_the_version_the_shim_was_written_for():
    version = importlib.metadata.version("megatron-core")
    assert cpu_targets.version_warning(version) is None, version


def test_other_versions_are_warned_about_and_missing_targets_refused(monkeypatch):
    assert cpu_targets.version_warning(WRITTEN_FOR + ".7") is None
    message = cpu_targets.version_warning("0.17.0")
    assert message and "megatron-core 0.17.0" in message and f"written for {WRITTEN_FOR}.x" in message
    assert cpu_targets.version_warning("0.160.0") is not None  # not a prefix match on "0.16"

    bogus = ("megatron.core.utils:no_such_function", "megatron.core.no_such_module:f")
    assert [m.split(" ")[0] for m in missing_targets(bogus)] == list(bogus)
    with pytest.raises(RuntimeError, match="megatron.core.utils:no_such_function .*PATCH_TARGETS"):
        cpu_targets.check_megatron(PATCH_TARGETS + bogus[:1])
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.0")
    with pytest.warns(UserWarning, match="megatron-core 0.17.0 is installed; the CPU shim"):
        cpu_targets.check_megatron()


def test_gpu_paths_without_transformer_engine(monkeypatch):
    """Found on an H100 without TE (docs/benchmarks.md, "GPU"): megatron-core imports its TE
    wrappers anyway (as MagicMock subclasses), and its MoE router needs `te_general_gemm`."""
    from megatron.core.transformer.moe import moe_utils

    from megatron_bridge.runtime import megatron_fixes
    from megatron_bridge.runtime.blocks.attention import te_attention_class
    from megatron_bridge.runtime.groups import comm_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert te_attention_class() is None  # no TE here: never the mock
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    megatron_fixes.apply()
    assert moe_utils.te_general_gemm is None
    assert comm_device() == torch.device("cpu")  # no NCCL group here


def test_megatron_imports_without_inductor_or_wandb_on_cpu():
    """runtime/cpu_import.py: in a fresh interpreter without CUDA, `import megatron.core` builds no
    torch.compile wrapper (no TorchInductor import) and does not import wandb; afterwards
    torch.compile is torch's again and `import wandb` is not blocked."""
    import subprocess
    import sys

    probe = (
        "import sys, torch, megatron_bridge; real = torch.compile\n"
        "import megatron.core\nfrom megatron.core.models.gpt import GPTModel\n"
        "from megatron.core.jit import jit_fuser\n"
        "print(sorted(m for m in ('torch._inductor.compile_fx', 'wandb') if m in sys.modules))\n"
        "print(torch.compile is real, jit_fuser(len) is len)\n"
        "print('wandb' not in sys.modules)"  # not left as None: `import wandb` imports it normally
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["[]", "True True", "True"], out.stdout
