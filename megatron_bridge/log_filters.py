"""Log records dropped in every process of ours: noise that names nothing the user can act on.

transformers imports torchao wherever it is installed (its torchao quantizer, at the first
modeling import), and torchao logs a warning for each of its CUDA-only extensions a host
cannot load, torch one for each Enum torchao registers with its pytree. Only those records are
dropped (the loggers' other warnings stay); torch-free, installed at the package's import."""

from __future__ import annotations

import logging

_DROP = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _Drop(logging.Filter):
    def __init__(self, needles: tuple[str, ...]) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.needles)


def install() -> None:
    for name, needles in _DROP.items():
        log = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in log.filters):
            log.addFilter(_Drop(needles))
