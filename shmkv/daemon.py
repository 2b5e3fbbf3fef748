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
import logging
import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shmkv.config import ShmkvConfig, load_config, parse_listen
from shmkv.controller import MAX_BODY_BYTES, Controller
from shmkv.disk.tier import DiskTier
from shmkv.errors import ShmkvError
from shmkv.maintainer import MaintainerRole
from shmkv.paths import daemon_lock, runtime_dir
from shmkv.remote.tier import open_remote
from shmkv.store import open_store

log = logging.getLogger("shmkv.daemon")

EXIT_CONFIG, EXIT_ALREADY_RUNNING, EXIT_CANNOT_SERVE = 2, 3, 4
READY = "shmkv daemon ready"


# ------------------------------------------------------------------ HTTP --
class _Handler(BaseHTTPRequestHandler):
    server_version = "shmkv"
    protocol_version = "HTTP/1.1"
    controller: Controller  # set on the subclass made by _serve

    def _serve(self) -> None:
        try:
            n = int(self.headers.get("Content-Length", "0"))  # no header: no body
        except ValueError:
            n = -1
        if n < 0 or n > MAX_BODY_BYTES:
            status = 413 if n > MAX_BODY_BYTES else 400
            self.controller.count(status)
            self._reply(status, "application/json",
                        b'{"error": "Content-Length malformed or over the limit"}\n', close=True)
            return
        body = self.rfile.read(n)
        status, ctype, out = self.controller.handle(self.command, self.path, body)
        self._reply(status, ctype, out)

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


class _UnixHTTPServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    allow_reuse_address = False

    def server_bind(self) -> None:
        old = os.umask(0o177)  # the socket file is born 0600
        try:
            super().server_bind()
        finally:
            os.umask(old)
        os.chmod(self.server_address, 0o600)


class _TCPHTTPServer(ThreadingHTTPServer):
    daemon_threads = True


def make_server(listen: str, controller: Controller) -> tuple[socketserver.BaseServer, str]:
    """A bound server for `listen` and the URL it answers on."""
    kind, where, port = parse_listen(listen)
    handler = type("Handler", (_Handler,), {"controller": controller})
    if kind == "unix":
        if os.path.exists(where):
            st = os.lstat(where)
            if not (st.st_mode & 0o170000 == 0o140000 and st.st_uid == os.geteuid()):
                raise OSError(f"{where} exists and is not our socket; remove it or pick another path")
            os.unlink(where)  # a socket left by a daemon that died (we hold the daemon lock)
        parent = os.path.dirname(where) or "."
        if not os.path.isdir(parent):
            raise OSError(f"directory {parent} of the controller socket does not exist")
        server: socketserver.BaseServer = _UnixHTTPServer(where, handler)
        return server, f"unix:{where}"
    family = socket.AF_INET6 if ":" in where else socket.AF_INET
    cls = type("Server", (_TCPHTTPServer,), {"address_family": family})
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
        self.role = MaintainerRole(cfg, self.store, disk, standby_s=0.2, yield_to_daemon=False, remote=self.remote)
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

    daemon = Daemon(cfg)
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
