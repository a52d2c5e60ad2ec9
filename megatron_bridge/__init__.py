"""megatron_bridge: one Hydra recipe → a validated Megatron-core / DeepSpeed layout.

Importing the package is cheap on purpose (no torch, no megatron): `mbr check` must answer
for 16,384 ranks in well under a second on a laptop.
"""

__version__ = "0.1.0"

from megatron_bridge.runtime import cpu_import as _cpu_import  # noqa: E402  (torch-free: a finder only)

_cpu_import.install()

from megatron_bridge import log_filters as _log_filters  # noqa: E402  (torch-free)

_log_filters.install()
