"""What transformers' own loading does with a model of the transformers backend: whether
`from_pretrained` reads back the names `save_pretrained` writes (a model whose checkpoint does not
load back has no reference to verify against, and an export of it would load at random), and the
package a model's classes need where it is not installed (one `error:` line naming it, not a
traceback). backends/transformers/meta.py refuses from these while it reads the meta-device model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from megatron_bridge.bridge.hf_config import MissingPackage

# transformers' requires_backends message: "TimmWrapperModel requires the timm library but it was
# not found in your environment. You can install it with pip: `pip install timm`. ..."
_REQUIRES = re.compile(r"(\w+) requires the (\S+) library")
_PIP = re.compile(r"pip install ([\w.\-\[\]]+)")


def needs_package(arch: str, e: ImportError) -> MissingPackage:
    """The refusal of `arch`, whose classes raised `e` while being built: the package to install
    (the pip name transformers' message gives, else the missing module's top-level name) and
    the class that asked for it, where the message says."""
    text = str(e)
    requires = _REQUIRES.search(text)
    pip = _PIP.search(text)
    if pip:
        package = pip.group(1)
    elif requires:
        package = requires.group(2)
    elif isinstance(e, ModuleNotFoundError) and e.name:
        package = e.name.split(".")[0]
    else:
        first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
        return MissingPackage(
            f"{arch} cannot be built here: an import its classes need failed ({first})",
            "install what that import needs (its message above says what)",
        )
    who = f" ({requires.group(1)})" if requires else ""
    return MissingPackage(f"{arch} needs the {package} package{who}, not installed", f"pip install {package}")


def read_back_misses(model: Any, saved: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """{module tensor: (its saved name, the name transformers' loader reads that as)} for the
    saved names `from_pretrained` does not map back onto the tensor that saved them: the loading
    direction's conversion mapping (which keeps the PrefixChange entries saving drops) and its
    base-model-prefix fallback, as `convert_and_load_state_dict_in_model` runs them, key order
    included (a GroupWeightRename arms on its first key). A name a converter takes is the
    converter's (experts.py, fused.py, split.py), not a rename, and is not judged here."""
    # transformers imported here: the core imports third-party packages only inside functions
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    loading = get_model_conversion_mapping(model)
    renamings = [c for c in loading if isinstance(c, WeightRenaming)]
    converters = [c for c in loading if isinstance(c, WeightConverter)]
    state = model.state_dict()
    prefix = model.base_model_prefix
    out = {}
    for name, held in sorted(saved.items(), key=lambda kv: dot_natural_key(kv[1])):
        got, pattern = rename_source_key(held, renamings, converters, prefix, state)
        if got not in state and held in state:  # transformers' own retry: the name as saved
            got, pattern = rename_source_key(held, [], [], prefix, state)
        if pattern is None and got != name:
            out[name] = (held, got)
    return out


__all__ = ["needs_package", "read_back_misses"]
