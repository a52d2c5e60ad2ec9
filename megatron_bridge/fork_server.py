"""One `fork_launch` for a whole test session: a server that imports torch, megatron-core,
transformers and DeepSpeed once, then forks a launcher per request, which forks its ranks.

    python -m megatron_bridge.fork_server SOCKET      (tests/dist/conftest.py starts it)

Why: `fork_launch` already spares the ranks their imports, but each launch still imported
everything once (~10 s of CPU on the 2-core CI box, ~30 launches in tests/dist:
docs/contributing.md, "Test time"). Here a launch costs a fork.

A request (`launch`, from `testing.run_torchrun` when `$MBR_FORK_SERVER` names a socket) carries
fork_launch's command line, the environment, the working directory and the file descriptor the
output goes to (SCM_RIGHTS). The server forks; the child starts a new session, takes that
descriptor as stdout and stderr, the directory and the environment, and runs `fork_launch.launch`
— from there on it is the launcher a `python -m megatron_bridge.fork_launch` would be, the
ranks its children. The server reaps it and sends its exit code back. The caller holds the
launcher's pid: its timeout kills that process tree as it would a launcher it started.

Only the environment of the server's own imports differs from a fresh launcher's: variables
read at import time (none of PRELOAD reads the rank's) are the server's. The server forks only
while it has one thread (jemalloc's aside); it exits when its parent (pytest) is gone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback

from megatron_bridge import fork_launch
from megatron_bridge.forking import threads

SERVER_ENV = "MBR_FORK_SERVER"  # the socket of a running server; unset: every launch is a process


class Launch:
    """A launcher started by the server: its pid, and its exit code once the server reports it
    (newline-separated JSON on the connection: the pid, later the exit code)."""

    def __init__(self, conn: socket.socket):
        self.conn, self._buf = conn, b""
        self.returncode: int | None = None
        reply = self._message(None)
        if reply is None or "pid" not in reply:
            conn.close()
            raise OSError((reply or {}).get("error", "the fork server closed the connection"))
        self.pid: int = reply["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired after `timeout` seconds (as Popen.wait)."""
        if self.returncode is None and not self._exit(timeout):
            raise subprocess.TimeoutExpired(f"fork_launch (pid {self.pid})", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _exit(self, timeout: float | None) -> bool:
        try:
            reply = self._message(timeout)
        except TimeoutError:
            return False
        self.returncode = -signal.SIGKILL if reply is None else int(reply["exit"])  # server gone: as killed
        self.conn.close()
        return True

    def _message(self, timeout: float | None) -> dict | None:
        """The next message; None at the end of the connection; TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.conn], [], [], left)[0]:
                raise TimeoutError
            chunk = self.conn.recv(4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


def launch(sock_path: str, argv: list[str], env: dict[str, str], cwd: str | None, out_fd: int) -> Launch:
    """Ask the server at `sock_path` to run `fork_launch` with `argv`; OSError if it is not there
    or will not fork."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock_path)
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd or os.getcwd()}).encode()
        socket.send_fds(conn, [len(request).to_bytes(8, "little") + request], [out_fd])
    except BaseException:
        conn.close()
        raise
    return Launch(conn)


def _receive(conn: socket.socket) -> tuple[dict, int]:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
    size = int.from_bytes(msg[:8], "little")
    body = msg[8:]
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise OSError("request cut short")
        body += chunk
    if len(fds) != 1:
        raise OSError("request without its output descriptor")
    return json.loads(body), fds[0]


def _run_launcher(listener: socket.socket, open_conns: list[socket.socket], req: dict, out_fd: int) -> None:
    """In the forked child: become the launcher of `req`; exits with its code. A rank it forks
    comes back through here with the rank's SystemExit, which goes on up to the interpreter's
    own exit (atexit handlers, flushes) as in a process started for the rank."""
    me, code = os.getpid(), 1
    try:
        listener.close()
        for c in open_conns:  # the callers' connections: only the server answers them
            c.close()
        os.setsid()  # its own session: the caller's kill of this tree reaches nothing else
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = os.getcwd()  # what `python -m` puts first, for `-m` targets
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        code = fork_launch.launch(fork_launch._parse(req["argv"]), req["argv"])
    except SystemExit as e:
        if os.getpid() != me:
            raise
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        if os.getpid() != me:
            raise
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(sock_path: str) -> int:
    fork_launch.preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    conns: dict[int, socket.socket] = {}  # launcher pid -> its caller's connection
    while os.getppid() == parent:
        for pid, code in _reaped():
            conn = conns.pop(pid, None)
            if conn is not None:
                try:
                    _send(conn, {"exit": code})
                except OSError:
                    pass  # the caller is gone (its timeout killed the tree)
                conn.close()
        if not select.select([listener], [], [], 0.05)[0]:
            continue
        conn, _ = listener.accept()
        try:
            req, out_fd = _receive(conn)
        except (OSError, ValueError) as e:
            _reply(conn, {"error": f"bad request: {e}"})
            continue
        if threads() != 1:  # an import started a thread: the caller starts a process
            os.close(out_fd)
            _reply(conn, {"error": "the fork server has a second thread; not forking"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_launcher(listener, [*conns.values(), conn], req, out_fd)
        os.close(out_fd)
        conns[pid] = conn
        try:
            _send(conn, {"pid": pid})
        except OSError:
            pass  # the caller is gone; its launch is reaped as any other
    return 0


def _send(conn: socket.socket, data: dict) -> None:
    conn.sendall(json.dumps(data).encode() + b"\n")


def _reply(conn: socket.socket, data: dict) -> None:
    try:
        _send(conn, data)
    except OSError:
        pass  # the caller is gone
    finally:
        conn.close()


def _reaped() -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
