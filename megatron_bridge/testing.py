"""Run code under a real `torchrun` (gloo on CPU) and collect what every rank reports.

    results = run_torchrun(["tests/dist/scripts/check_groups.py", "--layouts", "tp2"], nproc=8)

launches `python -m torch.distributed.run --nproc-per-node N --master-port <free port> ...`
with a hard timeout: on expiry the launcher, every worker (torchrun puts each in its own
session) and their children are SIGKILLed and the call raises `TorchrunError` with the
captured output, so a deadlock fails a test instead of hanging CI. Each rank reports a JSON-able dict with `report(...)`; the harness returns those dicts
ordered by rank. A script can be a path or `-m module` (any torchrun script arguments).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_bridge import fork_server
from megatron_bridge.fork_server import SERVER_ENV

RESULT_DIR_ENV = "MBR_TEST_RESULT_DIR"
DEFAULT_TIMEOUT = 300.0
# `torchrun` (the default) or `fork`: megatron_bridge.fork_launch, the same ranks and
# environment forked after the imports (tests/dist/conftest.py picks it for its tests).
LAUNCHER_ENV = "MBR_TEST_LAUNCHER"
LAUNCHERS = ("torchrun", "fork")


class TorchrunError(AssertionError):
    """A torchrun launch failed (non-zero exit, timeout, or a rank that reported nothing).
    `output` holds everything the launcher and the ranks printed."""

    def __init__(self, message: str, output: str = "", returncode: int | None = None):
        self.output = output
        self.returncode = returncode
        tail = output[-20000:]
        super().__init__(f"{message}\n----- torchrun output (last {len(tail)} chars) -----\n{tail}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_process_groups(seed: int = 0):
    """megatron-core's process groups for this one process (gloo, world size 1), for tests
    that build a model in-process; torn down and the environment restored after."""
    # torch and megatron load only for tests that build a model; the launch helpers stay light
    from megatron_bridge.parallel.dims import ParallelDims
    from megatron_bridge.runtime import groups  # see above

    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    groups.initialize(ParallelDims(world_size=1, gpus_per_node=1), seed=seed)
    try:
        yield
    finally:
        groups.destroy()
        os.environ.clear()
        os.environ.update(env)


def report(data: Mapping, *, rank: int | None = None) -> None:
    """Called inside a rank: store this rank's result for the harness (merged with earlier
    reports of the same rank). Outside the harness it prints the data instead."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    out_dir = os.environ.get(RESULT_DIR_ENV)
    if not out_dir:
        print(json.dumps({"rank": rank, **data}, default=str))
        return
    path = Path(out_dir) / f"rank{rank}.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(data)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, default=str))
    tmp.replace(path)


def launch_env() -> dict[str, str]:
    """This process's environment with the defaults every test launch gets (one thread per
    rank, unbuffered output, transformers' UserWarnings quiet); the fork server's too."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    return env


def run_torchrun(
    script_or_module_args: Sequence[str],
    nproc: int,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    expect_results: bool = True,
    launcher: str | None = None,
) -> list[dict]:
    """Launch `torchrun --nproc-per-node nproc <script_or_module_args>` and return the per-rank
    dicts reported with `report()`, ordered by rank. Raises `TorchrunError` (with the output) on
    a non-zero exit, on timeout (after killing every process of the launch), or when a rank
    reported nothing while `expect_results`. `launcher` (default: $MBR_TEST_LAUNCHER, else
    `torchrun`): `fork` starts the same ranks with `megatron_bridge.fork_launch` instead."""
    args = list(script_or_module_args)
    launcher = launcher or os.environ.get(LAUNCHER_ENV) or "torchrun"
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}: one of {LAUNCHERS}")
    with tempfile.TemporaryDirectory(prefix="mbr-torchrun-") as out_dir:
        run_env = launch_env()
        run_env.update({RESULT_DIR_ENV: out_dir, "TORCHELASTIC_ERROR_FILE": str(Path(out_dir) / "error.json")})
        run_env.update(env or {})
        start = time.monotonic()
        for attempt in range(2):  # a second try only if the free port was taken meanwhile
            for stale in Path(out_dir).glob("rank*.json"):
                stale.unlink()
            returncode, output = _launch(args, nproc, out_dir, run_env, cwd, timeout, launcher)
            if returncode == 0 or not _port_clash(output) or attempt:
                break
        if returncode != 0:
            raise TorchrunError(
                f"torchrun {' '.join(args)} (nproc={nproc}) exited with code {returncode} "
                f"after {time.monotonic() - start:.1f} s",
                output,
                returncode,
            )
        results = []
        for rank in range(nproc):
            path = Path(out_dir) / f"rank{rank}.json"
            if path.exists():
                results.append(json.loads(path.read_text()))
            elif expect_results:
                raise TorchrunError(f"rank {rank} reported no result", output, returncode)
            else:
                results.append({})
        return results


def torchrun_cmd(nproc: int, *args: str, launcher: str = "torchrun") -> list[str]:
    """A local torchrun on a free port, no restarts: the command every test launch uses
    (`launcher="fork"`: the same command line for megatron_bridge.fork_launch)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run" if launcher == "torchrun" else "megatron_bridge.fork_launch",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--max-restarts",
        "0",
        *args,
    ]


def _launch(args, nproc, out_dir, run_env, cwd, timeout, launcher):
    cmd = torchrun_cmd(nproc, *args, launcher=launcher)
    log_path = Path(out_dir) / "output.log"
    with open(log_path, "wb") as log:
        proc = _forked(cmd[3:], run_env, cwd, log.fileno()) if launcher == "fork" else None
        proc = proc or subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=run_env,
            cwd=cwd,
            start_new_session=True,  # never in pytest's group: our kills stay ours
        )
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            raise TorchrunError(
                f"torchrun {' '.join(args)} (nproc={nproc}) timed out after {timeout:.0f} s; "
                "all its processes were killed",
                log_path.read_text(errors="replace"),
            ) from None
        finally:
            if proc.poll() is None:
                _kill_tree(proc)
    return returncode, log_path.read_text(errors="replace")


def _forked(argv, run_env, cwd, out_fd):
    """The launch from the session's fork server (`$MBR_FORK_SERVER`, megatron_bridge/fork_server.py:
    the imports done once per pytest session), or None: start a process instead."""
    sock = run_env.get(SERVER_ENV)
    if not sock:
        return None
    try:
        return fork_server.launch(sock, argv, run_env, cwd, out_fd)
    except OSError:
        return None


def _port_clash(output: str) -> bool:
    return "EADDRINUSE" in output or "address already in use" in output.lower()


def _process_tree(root: int) -> list[int]:
    """`root` and all its descendants (Linux /proc; psutil elsewhere). torchrun starts every
    worker in a new session, so killing the launcher's process group alone would orphan them."""
    try:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
    except FileNotFoundError:
        try:
            import psutil

            return [root] + [p.pid for p in psutil.Process(root).children(recursive=True)]
        except Exception:
            return [root]
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher, every worker it started and their children (each one's process
    group too), then reap the launcher."""
    for _ in range(3):  # repeat: a dying launcher may still be spawning
        tree = _process_tree(proc.pid) if proc.poll() is None else []
        groups = {proc.pid}
        for pid in tree:
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                pass
        for pgid in groups:
            if pgid in tree:  # only groups led by a process of this launch
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not tree:
            break
        time.sleep(0.2)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


__all__ = ["run_torchrun", "report", "free_port", "TorchrunError", "RESULT_DIR_ENV", "DEFAULT_TIMEOUT", "LAUNCHER_ENV"]
