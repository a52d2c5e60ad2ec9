"""A local launcher for tests: torchrun's environment for N ranks on this host, each rank
forked from one process that has already imported torch, megatron-core and this package.

    python -m megatron_bridge.fork_launch --nproc-per-node 4 --master-addr 127.0.0.1 \\
        --master-port 29500 script.py ARGS...        (or -m module ARGS...)

Why: on the 2-core CI box every rank of a torchrun launch spends ~6-8 s of CPU importing the
same modules, and torchrun's agent ~3 s more — for a 4-rank launch more than the test's own
work (docs/contributing.md, "Test time"). Forked after the imports, the ranks start in
milliseconds. Everything after the start is what torchrun gives: separate processes, the same
environment variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, ...), real gloo groups; the ranks are this process's
children (so orphan protection sees a launcher parent); when one rank fails the others get
SIGTERM, then SIGKILL after a grace period, and the launch exits non-zero; SIGTERM/SIGINT to
the launcher go to every rank.

What it is not: an elastic agent (no restarts, no rendezvous, one node). Tests of the launch
itself — torchrun's agent, restarts, signals, multi-node — use torchrun. Forking is safe only
while this process has one thread (jemalloc's, which forks safely, aside) and has not started
torch's thread pools; where an import started another thread, it replaces itself with torchrun
(same arguments) instead of forking.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import runpy
import signal
import sys
import time
import uuid

from megatron_bridge.forking import threads

# What the ranks of a test launch import anyway: train/job brings torch, megatron-core and the
# runtime (through the CPU shim's import hook); the recipe composer (Hydra), the bridge,
# transformers' model base and torch._dynamo (which megatron-core's fused functions import on
# first call) are imported lazily by every job. Importing them here, before any rank exists,
# must not depend on the rank: none of them reads RANK/WORLD_SIZE at import time.
PRELOAD = (
    "megatron_bridge.train.job",
    "megatron_bridge.train.runner",
    "megatron_bridge.config.compose",
    "megatron_bridge.bridge",
    "hydra.compose",
    "torch._dynamo",
    "transformers.modeling_utils",
    "deepspeed",  # ~2.5 s: it imports mlflow (pyarrow, fastapi, pydantic) when installed
    "deepspeed.runtime.zero.muon.muon_optimizer",  # ~1.8 s (torch._inductor), at deepspeed.initialize
)
GRACE_S = 10.0  # SIGTERM to SIGKILL for the surviving ranks of a failed launch


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_bridge.fork_launch")
    ap.add_argument("--nproc-per-node", type=int, required=True)
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--max-restarts", type=int, default=0, help="accepted for torchrun's command line; must be 0")
    ap.add_argument("-m", dest="module", action="store_true", help="the target is a module")
    ap.add_argument("target")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.max_restarts:
        ap.error("fork_launch does not restart ranks; use torchrun for --max-restarts")
    return a


def _torchrun_instead(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *argv])


def _rank_env(a: argparse.Namespace, rank: int, run_id: str) -> dict[str, str]:
    n = str(a.nproc_per_node)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": n,
        "LOCAL_WORLD_SIZE": n,
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": n,
        "MASTER_ADDR": a.master_addr,
        "MASTER_PORT": str(a.master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def _run_rank(a: argparse.Namespace, rank: int, run_id: str) -> None:
    """In the forked child: become rank `rank` and run the target as `__main__`. Ends with
    SystemExit, which unwinds to the interpreter's own exit (atexit handlers, flushes) exactly
    as a process started for the rank would."""
    os.environ.update(_rank_env(a, rank, run_id))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code: int | str | None = 0
    try:
        if a.module:
            sys.argv = [a.target, *a.args]
            runpy.run_module(a.target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [a.target, *a.args]
            sys.path[0] = os.path.dirname(os.path.abspath(a.target))
            runpy.run_path(a.target, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.exit(code)


def _supervise(children: dict[int, int]) -> int:
    """Wait for every rank; on the first failure stop the rest (SIGTERM, then SIGKILL)."""
    failed = False
    deadline = None

    def forward(signum, _frame):
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                forward(signal.SIGKILL, None)
                deadline = None
            time.sleep(0.05)
            continue
        rank = children.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = True
            print(f"fork_launch: rank {rank} (pid {pid}) exited with {code}; stopping the others", file=sys.stderr)
            forward(signal.SIGTERM, None)
            deadline = time.monotonic() + GRACE_S
    return 1 if failed else 0


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports made is moved out of the cyclic GC's generations: a rank's collections
    # then neither walk it nor write its headers (each write copies a page the parent shares).
    gc.freeze()


def launch(a: argparse.Namespace, argv: list[str]) -> int:
    """Fork the ranks of `a` and supervise them (torchrun instead beside a second thread)."""
    if threads() != 1:  # an import started a thread: forking now could copy a held lock
        _torchrun_instead(argv)
    run_id = uuid.uuid4().hex[:12]
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict[int, int] = {}
    for rank in range(a.nproc_per_node):
        pid = os.fork()
        if pid == 0:
            _run_rank(a, rank, run_id)  # never returns
        children[pid] = rank
    return _supervise(children)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = _parse(argv)
    preload()
    return launch(a, argv)


if __name__ == "__main__":
    sys.exit(main())
