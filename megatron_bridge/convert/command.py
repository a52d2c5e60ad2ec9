"""The body of `mbr convert` / `export` / `reshard`, and what it does before anything heavy
is imported: transparent huge pages for torch's allocator and the source's read-ahead.
"""

import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STARTUP_READ_AHEAD = 2**30  # at least this much, or a quarter of the available memory if more


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def read_ahead_source(argv: Sequence[str], budget: int | None = None) -> None:
    """Ask the kernel to start reading `src=`'s files (in name order, up to `budget` bytes:
    by default a quarter of the available memory, at least 1 GiB) into the page cache
    before anything else: the disk works during the command's start-up (imports, Hydra)
    instead of idling, and for models that fit the budget the conversion then reads from
    memory. Page cache, not process memory (the kernel drops it under pressure); stdlib
    only; anything unexpected (no src, unreadable files, no fadvise) is silently skipped —
    the command itself reports real problems."""
    if budget is None:
        budget = max(STARTUP_READ_AHEAD, _available_memory() // 4)
    src = next((a.split("=", 1)[1] for a in argv if a.startswith("src=")), None)
    if not src or not hasattr(os, "posix_fadvise") or not os.path.isdir(src):
        return
    try:
        files = sorted(p for p in Path(src).rglob("*") if p.is_file() and not p.name.endswith(".json"))
        for p in files:
            if budget <= 0:
                break
            n = min(p.stat().st_size, budget)
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, n, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
            budget -= n
    except OSError:
        pass


def use_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages; effective only before torch is
    imported (the commands call it first). A conversion allocates a fresh buffer per tensor
    and per derived tensor; faulting those in 2 MiB at a time instead of 4 KiB made fresh
    buffers several times faster to fill (docs/benchmarks.md), and that is most of a
    conversion's CPU time. Memory use is unchanged (buffers are MBs, freed after each row).
    When torch is already loaded (a command called in-process, e.g. from tests) it would have
    no effect, so the environment is left alone rather than leaked to child processes."""
    import sys

    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def run_command(argv: Sequence[str], schema: str, command: str | Callable[[Any], int], doc: str | None) -> int:
    """The body of `mbr convert` / `export` / `reshard`: huge pages and the source's
    read-ahead first (before anything heavy is imported), then compose `options.<schema>`
    (`--cfg job` prints it, `--help` prints `doc`) and run `pipeline.run.<command>` (or
    `command(cfg)` when the caller passes a function)."""
    use_huge_pages()
    read_ahead_source(argv)
    # after the two lines above, by design: Hydra and the pipeline load while the kernel reads ahead
    from megatron_bridge.config.compose import parse_command, to_yaml
    from megatron_bridge.convert.pipeline import options  # see above: after the read-ahead starts

    cfg, args = parse_command(argv, getattr(options, schema), doc=doc)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    with sigterm_as_interrupt():
        if callable(command):
            return command(cfg)
        from megatron_bridge.convert.pipeline import run  # see above: after the read-ahead starts

        return getattr(run, command)(cfg)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (what `kill`, Slurm and Kubernetes send) cleans up like Ctrl-C: the partial
    output is removed, the lease released, exit 130. Main thread only (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
