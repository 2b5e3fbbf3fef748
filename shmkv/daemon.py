"""`python -m shmkv.daemon`: the cache's maintainer and controller, in one process.

    python -m shmkv.daemon [--config FILE] [--cache NAME] [--capacity 8GiB]
                           [--disk-dir DIR] [--listen 127.0.0.1:7470 | unix:/path]
                           [--background --log-file FILE]

It creates the segment or adopts the one vLLM processes already use, takes
the maintainer role (spill ahead, low watermark, reclaiming what dead
processes left; an embedded maintainer in a vLLM process hands it over), and
serves the controller API (shmkv.controller) on loopback or a 0600 unix
socket. Foreground by default; `--background` starts it detached, waits until
it serves, and prints its pid.

Invariants:
  * one daemon per cache: an exclusive flock on <runtime dir>/<cache>.daemon.lock,
    held for the process lifetime; a second daemon exits with status 3 and
    names the first one's pid;
  * SIGTERM / SIGINT stop serving, finish the maintenance pass, and detach:
    the segment and every chunk in it stay for the vLLM processes attached
    (and for the next daemon, which adopts it).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import resource
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shmkv.config import ShmkvConfig, io_threads, load_config, parse_listen
from shmkv.controller import MAX_BODY_BYTES, Controller
from shmkv.disk.tier import DiskTier
from shmkv.errors import ShmkvError
from shmkv.maintainer import MaintainerRole
from shmkv.paths import check_trusted_dir, daemon_lock, runtime_dir
from shmkv.remote import open_remote
from shmkv.store import open_store
from shmkv.tiers import TierChain

log = logging.getLogger("shmkv.daemon")

EXIT_CONFIG, EXIT_ALREADY_RUNNING, EXIT_CANNOT_SERVE = 2, 3, 4
READY = "shmkv daemon ready"


# ------------------------------------------------------------------ HTTP --
# Transport limits. A connection is idle while it waits for (the rest of) a
# request line or headers; it is closed after IO_TIMEOUT_S without a byte, and
# when MAX_CONNECTIONS are open the oldest idle one is closed to admit a new
# one (a busy server answers 503 only when none is idle).
IO_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 256
BACKLOG = 128
_MAX_CHUNK_LINE = 1024


class _BadBody(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server_version = "shmkv"
    protocol_version = "HTTP/1.1"
    timeout = IO_TIMEOUT_S  # socket timeout for every read and write of the connection
    controller: Controller  # set on the subclass made by _serve

    def _serve(self) -> None:
        self.server.mark(self.request, idle=False)  # type: ignore[attr-defined]
        try:
            body = self._read_body()
        except _BadBody as e:
            self.controller.count(e.status)
            self._reply(e.status, "application/json", (json.dumps({"error": str(e)}) + "\n").encode(), close=True)
            return
        status, ctype, out = self.controller.handle(self.command, self.path, body)
        self._reply(status, ctype, out)
        self.server.mark(self.request, idle=True)  # type: ignore[attr-defined]

    def _read_body(self) -> bytes:
        """The body exactly as the headers declare it; _BadBody otherwise (the
        connection is then closed: its framing cannot be trusted)."""
        te = self.headers.get_all("Transfer-Encoding") or []
        cl = self.headers.get_all("Content-Length") or []
        if te and cl:
            raise _BadBody(400, "both Transfer-Encoding and Content-Length given")
        if te:
            if [t.strip().lower() for t in ",".join(te).split(",")] != ["chunked"]:
                raise _BadBody(501, f"Transfer-Encoding {', '.join(te)!r} is not supported (only chunked)")
            return self._read_chunked()
        if len(cl) > 1:
            raise _BadBody(400, "more than one Content-Length")
        try:
            n = int(cl[0]) if cl else 0  # no header: no body
        except ValueError:
            n = -1
        if n < 0:
            raise _BadBody(400, f"Content-Length {cl[0]!r} is not a byte count")
        if n > MAX_BODY_BYTES:
            raise _BadBody(413, f"a body of {n} bytes is over the limit of {MAX_BODY_BYTES}")
        body = self.rfile.read(n)
        if len(body) != n:
            raise _BadBody(400, f"the body ended after {len(body)} of the {n} bytes declared")
        return body

    def _read_chunked(self) -> bytes:
        out = bytearray()
        while True:
            line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            if not line.endswith(b"\n") or len(line) > _MAX_CHUNK_LINE:
                raise _BadBody(400, "malformed or truncated chunk size line")
            size_s = line.split(b";", 1)[0].strip()
            try:
                size = int(size_s, 16)
            except ValueError:
                raise _BadBody(400, f"chunk size {size_s[:20]!r} is not hexadecimal") from None
            if size < 0:
                raise _BadBody(400, "negative chunk size")
            if size == 0:
                break
            if len(out) + size > MAX_BODY_BYTES:
                raise _BadBody(413, f"a chunked body over the limit of {MAX_BODY_BYTES} bytes")
            data = self.rfile.read(size)
            if len(data) != size or self.rfile.read(2) != b"\r\n":
                raise _BadBody(400, "truncated or malformed chunk")
            out += data
        for _ in range(64):  # trailer fields, up to the empty line
            line = self.rfile.readline(_MAX_CHUNK_LINE + 1)
            if line in (b"\r\n", b"\n"):
                return bytes(out)
            if not line.endswith(b"\n"):
                raise _BadBody(400, "truncated chunked trailer")
        raise _BadBody(400, "too many trailer fields")

    def _reply(self, status: int, ctype: str, out: bytes, close: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(out)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve  # noqa: N815 - http.server's names

    def address_string(self) -> str:
        return self.client_address[0] if isinstance(self.client_address, tuple) and self.client_address else "unix"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("controller %s: " + format, self.address_string(), *args)


class _ConnectionLimits:
    """Connection bookkeeping shared by the TCP and unix servers: a cap, idle
    eviction, and no busy loop when the process runs out of descriptors."""

    daemon_threads = True
    request_queue_size = BACKLOG
    max_connections = MAX_CONNECTIONS

    def _conns(self) -> dict:
        if not hasattr(self, "_conn_state"):
            self._conn_state: dict = {}  # socket -> monotonic time it became idle, or None (busy)
            self._conn_lock = threading.Lock()
            self.refused_busy = 0
            self.evicted_idle = 0
        return self._conn_state

    def mark(self, sock, *, idle: bool) -> None:
        conns = self._conns()
        with self._conn_lock:
            if sock in conns:
                conns[sock] = time.monotonic() if idle else None

    def _evict_idle(self) -> bool:
        conns = self._conns()
        with self._conn_lock:
            idle = [(t, s) for s, t in conns.items() if t is not None]
            if not idle:
                return False
            _t, victim = min(idle, key=lambda x: x[0])
            conns[victim] = None  # never picked twice
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its handler's read returns: it closes and leaves
        except OSError:
            pass
        self.evicted_idle += 1
        return True

    def verify_request(self, request, client_address) -> bool:
        conns = self._conns()
        with self._conn_lock:
            full = len(conns) >= self.max_connections
        if full and not self._evict_idle():
            self.refused_busy += 1
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Content-Length: 46\r\nConnection: close\r\n\r\n"
                                b'{"error": "too many connections, try again"}\n')
            except OSError:
                pass
            return False
        with self._conn_lock:
            conns[request] = time.monotonic()
        return True

    def shutdown_request(self, request) -> None:
        with self._conn_lock:
            self._conns().pop(request, None)
        super().shutdown_request(request)  # type: ignore[misc]

    def get_request(self):
        try:
            return super().get_request()  # type: ignore[misc]
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors: free one (the selector would report the
                # pending connection again at once, a busy loop otherwise).
                if not self._evict_idle():
                    threading.Event().wait(0.05)
            raise


class _UnixHTTPServer(_ConnectionLimits, socketserver.ThreadingUnixStreamServer):
    allow_reuse_address = False

    def server_bind(self) -> None:
        old = os.umask(0o177)  # the socket file is born 0600
        try:
            super().server_bind()
        finally:
            os.umask(old)
        os.chmod(self.server_address, 0o600)


class _TCPHTTPServer(_ConnectionLimits, ThreadingHTTPServer):
    pass


def _connection_cap() -> int:
    """MAX_CONNECTIONS, or fewer when the descriptor limit (raised to its hard
    limit first) leaves less room: the cap, not EMFILE, must be what bites."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(4, min(MAX_CONNECTIONS, soft - 64))


def make_server(listen: str, controller: Controller) -> tuple[socketserver.BaseServer, str]:
    """A bound server for `listen` and the URL it answers on."""
    kind, where, port = parse_listen(listen)
    handler = type("Handler", (_Handler,), {"controller": controller})
    if kind == "unix":
        check_trusted_dir(os.path.dirname(where) or ".")  # nobody else can swap the socket's directory
        if os.path.exists(where):
            st = os.lstat(where)
            if not (st.st_mode & 0o170000 == 0o140000 and st.st_uid == os.geteuid()):
                raise OSError(f"{where} exists and is not our socket; remove it or pick another path")
            os.unlink(where)  # a socket left by a daemon that died (we hold the daemon lock)
        parent = os.path.dirname(where) or "."
        if not os.path.isdir(parent):
            raise OSError(f"directory {parent} of the controller socket does not exist")
        ucls = type("UnixServer", (_UnixHTTPServer,), {"max_connections": _connection_cap()})
        server: socketserver.BaseServer = ucls(where, handler)
        return server, f"unix:{where}"
    family = socket.AF_INET6 if ":" in where else socket.AF_INET
    cls = type("Server", (_TCPHTTPServer,), {"address_family": family,
                                             "max_connections": _connection_cap()})
    server = cls((where, port), handler)
    host, bound_port = server.server_address[:2]
    return server, f"http://{'[' + host + ']' if family == socket.AF_INET6 else host}:{bound_port}"


# ---------------------------------------------------------------- daemon --
class Daemon:
    def __init__(self, cfg: ShmkvConfig) -> None:
        self.cfg = cfg
        self.lock = daemon_lock(cfg.cache_name)
        self.store = None
        self.role: MaintainerRole | None = None
        self.remote = None
        self.server: socketserver.BaseServer | None = None
        self.url = ""

    def start(self) -> None:
        """Everything up to serving; raises on what stops the daemon from starting."""
        cfg = self.cfg
        self.store = open_store(cfg)
        disk = None
        if cfg.disk_dir:
            disk = DiskTier(os.path.join(cfg.disk_dir, cfg.cache_name), capacity_bytes=cfg.disk_capacity,
                            level=cfg.disk_level, element_size=cfg.disk_shuffle_bytes or 2,
                            counter=self.store.bump)
        self.remote = open_remote(cfg, store=self.store, disk=disk, element_size=cfg.disk_shuffle_bytes or 2)
        chain = TierChain(self.store, [disk, self.remote], threads=io_threads(cfg))
        self.role = MaintainerRole(cfg, chain, standby_s=0.2, yield_to_daemon=False)
        self.role.start()
        self.server, self.url = make_server(cfg.listen, Controller(cfg, self.store, disk, self.role, self.remote))

    def serve(self) -> None:
        assert self.server is not None
        self.server.serve_forever(poll_interval=0.2)

    def request_stop(self, signum: int | None = None) -> None:
        if signum is not None:
            log.info("shmkv: daemon got %s: stopping", signal.Signals(signum).name)
        if self.server is not None:
            threading.Thread(target=self.server.shutdown, name="shmkv-stop", daemon=True).start()

    def close(self) -> None:
        if self.server is not None:
            self.server.server_close()
            if self.url.startswith("unix:"):
                try:
                    os.unlink(self.url[5:])
                except OSError:
                    pass
        if self.role is not None:
            self.role.stop()
        if self.remote is not None:
            self.remote.flush(timeout_s=30)
            self.remote.close()
        if self.store is not None:
            left = max(0, self.store.stats()["processes_attached"] - 1)
            self.store.close()
            log.info("shmkv: daemon detached from '%s'; the segment stays (%d other processes attached)",
                     self.cfg.cache_name, left)
        self.lock.release()


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m shmkv.daemon", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file of shmkv settings (same keys as the connector's)")
    ap.add_argument("--cache", help="cache name: the segment /dev/shm/NAME (default shmkv-<uid>)")
    ap.add_argument("--capacity", help="segment size when creating it, e.g. 8GiB")
    ap.add_argument("--disk-dir", help="disk tier directory (chunks go to DIR/<cache>/)")
    ap.add_argument("--disk-capacity", help="byte cap of the disk tier, e.g. 64GiB")
    ap.add_argument("--listen", help="controller address: loopback HOST:PORT (default 127.0.0.1:7470; "
                                     "port 0 picks one) or unix:/absolute/path")
    ap.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    ap.add_argument("--background", action="store_true", help="start detached; print the pid once it serves")
    ap.add_argument("--log-file", help="with --background: where its output goes "
                                       "(default <runtime dir>/<cache>.daemon.log)")
    return ap.parse_args(argv)


def _config(args: argparse.Namespace) -> ShmkvConfig:
    explicit = {"config_file": args.config, "cache_name": args.cache, "capacity": args.capacity,
                "disk_dir": args.disk_dir, "disk_capacity": args.disk_capacity, "listen": args.listen,
                "log_level": args.log_level}
    return load_config({k: v for k, v in explicit.items() if v is not None})


def _background(argv: list[str], cfg: ShmkvConfig, log_file: str | None) -> int:
    """Start the daemon detached, wait until it serves (or fails), report."""
    args = [a for a in argv if a != "--background"]
    if log_file:
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    else:
        rt = runtime_dir()
        log_file = rt.join(f"{cfg.cache_name}.daemon.log")
        fd = rt.open(f"{cfg.cache_name}.daemon.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    start = os.lseek(fd, 0, os.SEEK_END)
    proc = subprocess.Popen([sys.executable, "-m", "shmkv.daemon", *args], stdin=subprocess.DEVNULL,
                            stdout=fd, stderr=fd, start_new_session=True)
    os.close(fd)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with open(log_file, "rb") as f:
            f.seek(start)
            out = f.read().decode(errors="replace")
        if READY in out:
            print(f"shmkv daemon started: pid {proc.pid}, log {log_file}")
            print(next(line for line in out.splitlines() if READY in line))
            return 0
        if proc.poll() is not None:
            sys.stderr.write(out)
            print(f"shmkv daemon exited with status {proc.returncode} (log {log_file})", file=sys.stderr)
            return proc.returncode or 1
        time.sleep(0.1)
    print(f"shmkv daemon (pid {proc.pid}) did not report ready within 120 s; see {log_file}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    try:
        cfg = _config(args)
    except ShmkvError as e:
        print(f"shmkv daemon: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.background:
        return _background(argv, cfg, args.log_file)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    try:
        daemon = Daemon(cfg)  # opens the runtime directory: a planted one is refused here
    except (ShmkvError, OSError) as e:
        print(f"shmkv daemon: cannot start for cache '{cfg.cache_name}': {e}", file=sys.stderr)
        return EXIT_CANNOT_SERVE
    if not daemon.lock.try_acquire():
        pid = daemon.lock.holder_pid()
        print(f"shmkv daemon: another daemon (pid {pid}) already serves cache '{cfg.cache_name}' "
              f"(lock {daemon.lock.path}); stop it first with: kill -TERM {pid}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    try:
        try:
            daemon.start()
        except (ShmkvError, OSError) as e:
            print(f"shmkv daemon: cannot start for cache '{cfg.cache_name}': {e}", file=sys.stderr)
            return EXIT_CANNOT_SERVE
        signal.signal(signal.SIGTERM, lambda s, f: daemon.request_stop(s))
        signal.signal(signal.SIGINT, lambda s, f: daemon.request_stop(s))
        print(f"{READY}: pid {os.getpid()}, cache '{cfg.cache_name}', controller {daemon.url}", flush=True)
        log.info("shmkv: daemon pid %d serves cache '%s' on %s (disk tier %s)", os.getpid(), cfg.cache_name,
                 daemon.url, cfg.disk_dir or "off")
        daemon.serve()
        return 0
    finally:
        daemon.close()


if __name__ == "__main__":
    sys.exit(main())
