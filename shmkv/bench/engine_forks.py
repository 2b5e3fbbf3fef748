"""Engine processes forked from one Python that has imported vLLM once.

Importing torch and vLLM costs a new engine process ~7 s of CPU on 2 cores
(more than an in-process EngineCore's start itself). A fork server imports
them once; each engine it starts is an os.fork() of it, as vLLM forks its
own workers after importing torch. Only engines whose EngineCore runs in
their own process gain (EngineSpec.in_process): vLLM spawns a fresh Python
for a separate EngineCore anyway.

The server talks over a SOCK_SEQPACKET socket pair: a request is the
engine's spec and environment as JSON, with three file descriptors passed
alongside (SCM_RIGHTS): the engine's stdin, stdout and log. The forked
engine becomes its own session (its process group is its pid, as with
start_new_session), puts those on fds 0, 1 and 2, sets its environment and
serves exactly as `python -m shmkv.bench.engines` does. The server answers
the engine's pid and reaps it when it exits.

Environment read at interpreter start or at import (PYTHONPATH and its
sitecustomize, Triton's TRITON_INTERPRET, vLLM's model runner choice,
OpenMP's thread count) is the server's: one server per such environment
(IMPORT_ENV).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

# read before or while vLLM is imported (OpenMP reads its thread count when torch loads it):
# a server serves only engines that agree on them
IMPORT_ENV = ("PYTHONPATH", "VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET", "OMP_NUM_THREADS")
_MAX_MSG = 1 << 20


class ForkedProcess:
    """The Popen-like handle of a forked engine: its pid, pipes and exit
    (through a pidfd: the server, not this process, is its parent)."""

    def __init__(self, pid: int, stdin: Any, stdout: Any) -> None:
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._pidfd = None  # gone already
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while it runs; 0 once it has exited (its status is the server's)."""
        if self.returncode is None and (self._pidfd is None or select.select([self._pidfd], [], [], 0)[0]):
            self.returncode = 0
            self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._pidfd is not None:
            if not select.select([self._pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0)
        self.returncode = 0
        self._close_pidfd()
        return 0

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class ForkServer:
    """One server process with vLLM imported; `start` forks an engine of it."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen([sys.executable, "-m", "shmkv.bench.engine_forks", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one request at a time (engines may be started from several threads)
        ready = self.sock.recv(64)
        if ready != b"ready":
            raise RuntimeError(f"the engine fork server did not start ({self.proc.poll()})")

    def start(self, spec_json: str, env: dict[str, str], stdin_fd: int, stdout_fd: int, log_fd: int) -> int:
        msg = json.dumps({"spec": spec_json, "env": env}).encode()
        with self._lock:
            socket.send_fds(self.sock, [msg], [stdin_fd, stdout_fd, log_fd])
            reply = self.sock.recv(64)
        if not reply:
            raise RuntimeError(f"the engine fork server exited ({self.proc.poll()})")
        return int(reply)

    def close(self) -> None:
        self.sock.close()  # the server exits when its socket closes
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVERS: dict[tuple[str, ...], ForkServer] = {}  # the one registry: a server per import-time environment
_SERVERS_LOCK = threading.Lock()


def fork_engine(spec_json: str, env: dict[str, str], log_fd: int) -> ForkedProcess:
    """Start an engine (`spec_json`, an EngineSpec as JSON) as a fork of the
    server for `env`'s import-time variables (started on first use)."""
    key = tuple(env.get(k, "") for k in IMPORT_ENV)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or server.proc.poll() is not None:
            server = _SERVERS[key] = ForkServer(env)
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    try:
        pid = server.start(spec_json, env, stdin_r, stdout_w, log_fd)
    finally:
        os.close(stdin_r)
        os.close(stdout_w)
    return ForkedProcess(pid, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"))


def close_servers() -> None:
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


atexit.register(close_servers)


# ----------------------------------------------------------------- server ---
def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked engine: become its own session on the passed fds, serve, exit."""
    from shmkv.bench.engines import EngineSpec, _serve

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it; vLLM waits for its own children
    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    code = 0
    try:
        _serve(EngineSpec(**json.loads(request["spec"])))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_forks(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    import torch  # noqa: F401 - what every engine imports, once
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import shmkv.integration.vllm.connector  # noqa: F401
    from shmkv.bench import engines  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # engines are reaped as they exit
    sock.send(b"ready")
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 3)
        if not msg:
            return  # the client closed its end
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(json.loads(msg), fds)
        for f in fds:
            os.close(f)
        sock.send(str(pid).encode())


if __name__ == "__main__":
    _serve_forks(int(sys.argv[1]))
