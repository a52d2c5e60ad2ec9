"""The body of `mbr convert` / `export` / `reshard`, and what it does before anything heavy
is imported: transparent huge pages for torch's allocator and the source's read-ahead.
"""

import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_bridge.convert.bytemove.pool import usable_cores
from megatron_bridge.convert.formats.readahead import read_ahead_files
from megatron_bridge.forking import threads

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


def read_ahead_source(argv: Sequence[str], budget: int | None = None) -> Callable[[], None]:
    """Start reading `src=`'s files (in name order, up to `budget` bytes: by default a quarter
    of the available memory, at least 1 GiB) into the page cache before anything else, so
    the disk works during the command's start-up (imports, Hydra) instead of idling, and for
    models that fit the budget the conversion then reads from memory. The kernel is asked in
    read-ahead-window chunks (formats/readahead.py: one call per file read 8 MiB of it), and
    those calls block while the disk's queue is full, so they run in a forked child — only
    where `_may_fork` allows; in-process callers (tests, harnesses) read as they go. Page
    cache, not process memory (the kernel drops it under pressure); stdlib only; anything
    unexpected (no src, unreadable files) is silently skipped — the command itself reports
    real problems. Returns `stop`: ends the child if it is still reading, and reaps it."""
    src = next((a.split("=", 1)[1] for a in argv if a.startswith("src=")), None)
    if not src or not os.path.isdir(src) or not _may_fork():
        return lambda: None
    if budget is None:
        budget = max(STARTUP_READ_AHEAD, _available_memory() // 4)
    pid = os.fork()
    if pid == 0:  # the child: queue the reads, then leave without running the parent's exit handlers
        try:
            os.nice(19)  # the parent's imports and the compose child come first
            files = sorted(p for p in Path(src).rglob("*") if p.is_file() and not p.name.endswith(".json"))
            read_ahead_files(files, budget)
        except BaseException:
            pass
        finally:
            os._exit(0)

    def stop() -> None:
        try:
            if os.waitpid(pid, os.WNOHANG) == (0, 0):  # still queueing: what is left is not needed now
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        except OSError:
            pass

    return stop


def use_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for transparent huge pages; effective only before torch is
    imported (the commands call it first). A conversion allocates a fresh buffer per tensor
    and per derived tensor; faulting those in 2 MiB at a time instead of 4 KiB made fresh
    buffers several times faster to fill (docs/benchmarks.md), and that is most of a
    conversion's CPU time. Memory use is unchanged (buffers are MBs, freed after each row).
    When torch is already loaded (a command called in-process, e.g. from tests) it would have
    no effect, so the environment is left alone rather than leaked to child processes."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def run_command(argv: Sequence[str], schema: str, command: str | Callable[[Any], int], doc: str | None) -> int:
    """The body of `mbr convert` / `export` / `reshard`: huge pages and the source's
    read-ahead first (before anything heavy is imported), then compose `schemas.<schema>`
    (`--cfg job` prints it, `--help` prints `doc`) — in a child process while this one imports
    the pipeline, where that can overlap (`compose_beside`) — and run `pipeline.run.<command>`
    (or `command(cfg)` when the caller passes a function)."""
    use_huge_pages()
    stop_reading = read_ahead_source(argv)
    try:
        composed = compose_beside(argv, schema, doc)
        # after the lines above, by design: the pipeline loads while the disk reads ahead and the child composes
        from megatron_bridge.convert.pipeline import run, schemas

        cfg, print_cfg = composed() or _compose(argv, getattr(schemas, schema), doc)
        if print_cfg:
            from megatron_bridge.config.compose import to_yaml  # OmegaConf, only when printing

            print(to_yaml(cfg), end="")
            return 0
        with sigterm_as_interrupt():
            return command(cfg) if callable(command) else getattr(run, command)(cfg)
    finally:
        stop_reading()


def _compose(argv: Sequence[str], schema: type, doc: str | None) -> tuple[Any, str | None]:
    """(the config, `--cfg`'s value) composed in this process; Hydra and OmegaConf load only
    here. Plain dataclasses and a string: what the child sends needs neither to unpickle."""
    from megatron_bridge.config.compose import parse_command  # see above: after the read-ahead starts

    composed: tuple[Any, Any] = parse_command(argv, schema, doc=doc)
    return composed[0], composed[1].cfg


def _may_fork() -> bool:
    """A fork is safe and worth it: two cores to overlap on, no other thread (a lock one of
    them holds would stay held in the child), torch not loaded (its thread pools do not survive
    a fork), and this process's own stdout/stderr (a test harness's capture would not see the
    child's output)."""
    return (
        hasattr(os, "fork")
        and usable_cores() >= 2
        and threads() == 1
        and "torch" not in sys.modules
        and sys.stdout is sys.__stdout__
        and sys.stderr is sys.__stderr__
    )


def compose_beside(argv: Sequence[str], schema: str, doc: str | None) -> Callable[[], Any]:
    """Start composing `schemas.<schema>` from `argv` in a forked child; returns a function
    that waits for it: `_compose`'s (config, `--cfg`), or None when the caller must compose
    itself — when no child was started (`_may_fork`) or composing failed there. Hydra's compose (~0.5 s on the 2-core
    box) and importing the pipeline (~0.5 s) then overlap instead of adding up (docs/
    benchmarks.md, "Start-up"). The child reports only success: for any error (a bad override,
    `--help`, an interrupt) the caller composes again in-process, so the message, exit code,
    traceback under `debug=true` and warnings are exactly those of composing in-process. The
    result crosses an anonymous pipe from this process's own fork, pickled — in-memory IPC
    between two copies of this program, never a file."""
    if not _may_fork():
        return lambda: None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compose, send, and leave without running the parent's exit handlers
        os.close(read_end)
        data = b""  # what a failure sends: the parent's own compose reports it
        try:
            from megatron_bridge.convert.pipeline import schemas  # in the child: not the pipeline

            data = pickle.dumps(_compose(argv, getattr(schemas, schema), doc))
        except BaseException:
            pass
        try:
            with os.fdopen(write_end, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(write_end)

    def wait() -> Any:
        with os.fdopen(read_end, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        return pickle.loads(data) if data else None  # our own child, over our own pipe

    return wait


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
