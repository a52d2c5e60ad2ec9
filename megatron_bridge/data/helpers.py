"""megatron-core's C++ dataset index helpers (`megatron/core/datasets/helpers.cpp`).

`GPTDataset` builds its sample index and `BlendedDataset` its blending index with
`megatron.core.datasets.helpers_cpp`, a pybind11 extension. The megatron-core 0.16.1 wheel
ships it prebuilt (`helpers_cpp.cpython-311-x86_64-linux-gnu.so`), and that is what is used
whenever it imports. megatron-core's own fallback, `compile_helpers()`, runs `make` in the
package directory, which fails for a wheel install (the wheel has no Makefile, and
site-packages is often read-only), so when the prebuilt module is missing or does not load
(source install, another platform) `ensure_helpers()` compiles `helpers.cpp` once with the
C++ compiler (`$CXX`, else `c++`) against pybind11's headers (the `pybind11` package or the
copy inside torch), into a per-user cache keyed by the source's hash and the Python ABI
(`$MBR_CACHE_DIR/helpers/<key>/`, default `~/.cache/megatron_bridge`), under a file lock so
concurrent ranks compile it once, writing to a temporary name renamed into place. The compiled
module is then registered as `megatron.core.datasets.helpers_cpp`, so megatron-core's own
`from megatron.core.datasets.helpers_cpp import *` finds it.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from megatron_bridge.errors import UserError

HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"
_STATUS: str | None = None


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def helpers_source() -> Path:
    mega = _package_dir("megatron")
    src = mega / "core" / "datasets" / "helpers.cpp" if mega else None
    if src is None or not src.is_file():
        raise UserError("megatron-core's datasets/helpers.cpp is missing: reinstall megatron-core")
    return src


def cache_dir() -> Path:
    root = os.environ.get("MBR_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megatron_bridge")
    return Path(root) / "helpers"


def pybind11_includes() -> list[str]:
    """Include dirs holding pybind11/pybind11.h: the pybind11 package, else torch's copy."""
    try:
        import pybind11  # type: ignore

        return [pybind11.get_include()]
    except ImportError:
        pass
    torch_dir = _package_dir("torch")
    if torch_dir and (torch_dir / "include" / "pybind11" / "pybind11.h").is_file():
        return [str(torch_dir / "include")]
    raise UserError(
        "cannot compile megatron-core's dataset helpers: pybind11's headers were not found (pip install pybind11)"
    )


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        raise UserError(
            f"megatron-core's prebuilt dataset helpers (helpers_cpp) do not load here and no C++ compiler "
            f"({cxx}) is available to build them from helpers.cpp. Install g++ (or set CXX), or install "
            "a megatron-core wheel with the prebuilt extension."
        )
    return cxx


def compiled_path(root: Path | None = None) -> Path:
    src = helpers_source()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(src.read_bytes() + f"|{sys.version}|{suffix}".encode()).hexdigest()[:16]
    return (root or cache_dir()) / key / f"helpers_cpp{suffix}"


def compile_helpers(root: Path | None = None) -> Path:
    """Compile helpers.cpp into the cache (once; later calls return the cached file)."""
    out = compiled_path(root)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(out.parent / ".lock")):
        if out.is_file():  # another process compiled it while we waited
            return out
        tmp = out.parent / f".tmp-{os.getpid()}-{out.name}"
        cmd = [
            _compiler(),
            "-O3",
            "-Wall",
            "-shared",
            "-std=c++17",
            "-fPIC",
            f"-I{sysconfig.get_paths()['include']}",
            *[f"-I{d}" for d in pybind11_includes()],
            str(helpers_source()),
            "-o",
            str(tmp),
        ]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise UserError(
                f"compiling megatron-core's dataset helpers failed ({' '.join(cmd)}):\n{r.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, out)
    return out


def load_extension(path: Path, name: str = HELPERS_MODULE) -> ModuleType:
    """Load the compiled extension `path` as module `name` and register it in sys.modules."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None  # never None when a loader is given
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def quiet_megatron_import() -> None:
    """Import megatron.core without its "Transformer Engine and Apex are not installed"
    warnings (expected on CPU; the fallbacks are what this project uses there)."""
    import warnings

    if "megatron.core" in sys.modules:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        import megatron.core  # noqa: F401


def ensure_helpers() -> str:
    """Make `megatron.core.datasets.helpers_cpp` importable; returns how ('prebuilt: PATH' or
    'compiled: PATH'). Cheap after the first call. Call it on every rank before building
    datasets (megatron-core imports the module lazily, deep inside dataset construction)."""
    global _STATUS
    if _STATUS is not None and HELPERS_MODULE in sys.modules:
        return _STATUS
    quiet_megatron_import()
    try:
        import megatron.core.datasets.helpers_cpp as mod  # noqa: F401

        _STATUS = f"prebuilt: {mod.__file__}"
    except ImportError:
        path = compile_helpers()
        load_extension(path)
        _STATUS = f"compiled: {path}"
    return _STATUS
