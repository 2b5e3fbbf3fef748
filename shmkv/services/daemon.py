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
import subprocess
import sys
import time

from shmkv.config import ShmkvConfig, load_config
from shmkv.errors import ShmkvError
from shmkv.paths import daemon_lock, open_private_log, runtime_dir
from shmkv.services.controller import Controller
from shmkv.services.controller_auth import check_token_place, owner_socket_path, rotate_token, token_path
from shmkv.services.controller_http import ControllerServer
from shmkv.services.maintainer import MaintainerRole
from shmkv.store import OpenOutcome, Role, Store, open_store
from shmkv.tiers import TierChain, open_tiers

log = logging.getLogger("shmkv.daemon")

EXIT_CONFIG, EXIT_ALREADY_RUNNING, EXIT_CANNOT_SERVE = 2, 3, 4
READY = "shmkv daemon ready"


# ---------------------------------------------------------------- daemon --
class AlreadyServedError(ShmkvError):
    """Another daemon holds the segment's daemon role (another container's)."""


class Daemon:
    def __init__(self, cfg: ShmkvConfig) -> None:
        self.cfg = cfg
        self.lock = daemon_lock(cfg.cache_name)
        self.store = None
        self.role: MaintainerRole | None = None
        self.chain: TierChain | None = None
        self.server: ControllerServer | None = None
        self.url = ""
        self.token = ""  # the controller's bearer token, once started

    def start(self) -> None:
        """Everything up to serving; raises on what stops the daemon from
        starting, and then leaves no segment behind that this start created."""
        cfg = self.cfg
        check_token_place(cfg)  # before the segment: a bad token file refuses the start
        self.store = open_store(cfg)
        try:
            # NOTE: the runtime directory's lock sees daemons of this host namespace; the segment's
            # role lock sees those of every container sharing the segment
            if not self.store.try_hold_role(Role.DAEMON):
                raise AlreadyServedError(f"another shmkv daemon already serves segment '{cfg.cache_name}' (from "
                                         "another container or PID namespace: its runtime directory is not "
                                         "this one); stop it first")
            token = rotate_token(cfg)  # only the daemon that serves replaces it
            self.chain = open_tiers(cfg, self.store)
            self.role = MaintainerRole(cfg, self.chain, standby_s=0.2, yield_to_daemon=False)
            self.role.start()
            owner = owner_socket_path(cfg)
            if owner is not None:
                runtime_dir()  # made and checked (0700, ours) before a socket is bound in it
            self.server = ControllerServer(cfg.listen, Controller(cfg, self.store, self.chain, self.role), token,
                                           owner_socket=owner)
        except BaseException:
            self._undo_start()
            raise
        self.url, self.token = self.server.url, token
        log.info("shmkv: controller token in %s (clients read it there; TCP requests send it as a bearer token)",
                 token_path(cfg))

    def _undo_start(self) -> None:
        """After a refused start: stop what started, and remove the segment if
        this start created it and nobody else has attached it since."""
        created = self.store is not None and self.store.outcome is OpenOutcome.CREATED
        if self.role is not None:
            self.role.stop()
            self.role = None
        if self.chain is not None:
            self.chain.close(flush_timeout_s=0)
            self.chain = None
        if self.store is not None:
            alone = self.store.stats()["processes_attached"] <= 1
            self.store.close()
            self.store = None
            if created and alone:
                Store.unlink(self.cfg.cache_name, segment_dir=self.cfg.segment_dir)
                log.info("shmkv: removed segment '%s', which this refused start had created", self.cfg.cache_name)

    def serve(self) -> None:
        assert self.server is not None
        self.server.serve()

    def request_stop(self, signum: int | None = None) -> None:
        if signum is not None:
            log.info("shmkv: daemon got %s: stopping", signal.Signals(signum).name)
        if self.server is not None:
            self.server.stop()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.role is not None:
            self.role.stop()
        if self.chain is not None:
            self.chain.close(flush_timeout_s=30)
        if self.store is not None:
            left = max(0, self.store.stats()["processes_attached"] - 1)
            self.store.close()
            log.info("shmkv: daemon detached from '%s'; the segment stays (%d other processes attached)",
                     self.cfg.cache_name, left)
        self.lock.release()


DAEMON_HELP = """The cache's maintainer and controller, in one process (one per cache).

It creates the segment or adopts the one vLLM processes already use, keeps
memory below its watermark (spilling to the disk and remote tiers ahead of
need, reclaiming what dead processes left) and serves the controller API on
loopback or a 0600 unix socket. Foreground by default; --background starts it
detached, waits until it serves and prints its pid. SIGTERM or SIGINT detach
it: the segment and its chunks stay for the engines and the next daemon.

    shmkv daemon --capacity 8GiB --disk-dir /var/cache/shmkv
    shmkv daemon --listen unix:/run/shmkv/ctl.sock --background --log-file /var/log/shmkv.log
"""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="shmkv daemon", description=DAEMON_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file of shmkv settings (same keys as the connector's)")
    ap.add_argument("--cache", help="cache name: the segment <segment dir>/NAME (default shmkv-<uid>)")
    ap.add_argument("--segment-dir", help="the directory segments live in: a tmpfs of this uid, mode 0700 "
                                          "(default /dev/shm: POSIX shared memory)")
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
    explicit = {"config_file": args.config, "cache_name": args.cache, "segment_dir": args.segment_dir,
                "capacity": args.capacity,
                "disk_dir": args.disk_dir, "disk_capacity": args.disk_capacity, "listen": args.listen,
                "log_level": args.log_level}
    return load_config({k: v for k, v in explicit.items() if v is not None})


def _background(argv: list[str], cfg: ShmkvConfig, log_file: str | None) -> int:
    """Start the daemon detached, wait until it serves (or fails), report."""
    args = [a for a in argv if a != "--background"]
    if log_file:
        fd = open_private_log(log_file, "--log-file")
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
        try:
            return _background(argv, cfg, args.log_file)
        except (ShmkvError, OSError) as e:
            print(f"shmkv daemon: cannot start for cache '{cfg.cache_name}': {e}", file=sys.stderr)
            return EXIT_CANNOT_SERVE
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
        except AlreadyServedError as e:
            print(f"shmkv daemon: {e}", file=sys.stderr)
            return EXIT_ALREADY_RUNNING
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
