"""The maintainer role: exactly one process per cache keeps the shared tier
healthy, off vLLM's hot path.

  * spill ahead: the coldest evictable chunks (up to `spill_ahead` of the
    arena) are written to the disk tier before anyone needs their memory, so
    an eviction by a put rarely loses a chunk (`evicted_unspilled` counts it
    when it does);
  * watermark: when free space drops below `low_watermark`, spilled chunks
    are evicted from the cold end until it is back above it, so puts rarely
    find the tier full and never wait for disk I/O;
  * reclaim: leases and half-written chunks of dead processes are released.

The role is an exclusive flock on <runtime dir>/<cache>.maintainer.lock: the
daemon takes it when it runs (an embedded holder hands it over within a
second); without a daemon, the first vLLM scheduler process to get it does
the work in a background thread, and another takes over when it exits.

Promotion (disk -> shared tier) is not the maintainer's: the process that
found a disk hit promotes it (`promote`), so a lookup never waits on another
process.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Sequence

from shmkv.disk.tier import DiskTier
from shmkv.store import PutResult, Store

log = logging.getLogger("shmkv.maintainer")


def runtime_dir() -> str:
    """A private (0700) directory for lock and pid files."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"shmkv-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to another user")
    os.chmod(path, 0o700)
    return path


class PidLock:
    """An exclusive, process-lifetime flock on a 0600 file in the runtime
    directory that also records the holder's pid (released by the kernel
    when the holder exits, however it exits)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder_pid(self) -> int | None:
        """The pid written by the holder (None if never held or unreadable)."""
        try:
            with open(self.path) as f:
                return int(f.read().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def is_held_elsewhere(self) -> bool:
        """Whether another process holds the lock now."""
        if self._fd is not None:
            return False
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a shared lock we may have taken
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def MaintainerLock(cache_name: str) -> PidLock:  # noqa: N802 - a lock "class" per role
    """The maintainer role of one cache."""
    return PidLock(os.path.join(runtime_dir(), f"{cache_name}.maintainer.lock"))


def DaemonLock(cache_name: str) -> PidLock:  # noqa: N802
    """Held by the one daemon of a cache for its lifetime."""
    return PidLock(os.path.join(runtime_dir(), f"{cache_name}.daemon.lock"))


class Maintainer:
    def __init__(self, store: Store, disk: DiskTier | None, *, low_watermark: float = 0.10,
                 spill_ahead: float = 0.20, remote=None) -> None:
        self.store = store
        self.disk = disk
        self.remote = remote  # spilled chunks are also queued for the remote tier
        arena = store.arena_bytes
        self.low_bytes = int(arena * low_watermark)
        self.spill_ahead_bytes = int(arena * spill_ahead)

    # ------------------------------------------------------------- steps --
    def run_once(self) -> dict[str, int]:
        """One maintenance pass; returns what it did."""
        did = {"spilled": 0, "evicted": 0, "reclaimed": 0}
        r = self.store.reclaim()
        did["reclaimed"] = r["leases"] + r["writes"]
        if self.disk is None:
            return did
        st = self.store.stats()
        free = st["arena_bytes"] - st["bytes_used"]
        budget = self.spill_ahead_bytes + max(0, self.low_bytes - free)
        covered = 0
        for key, size, flags, ns in self.store.coldest(4096):
            if covered >= budget:
                break
            covered += size
            if not flags & 1:
                did["spilled"] += self.spill(key, ns)
        # evict spilled chunks from the cold end until above the low watermark
        while free < self.low_bytes:
            progressed = False
            for key, size, flags, _ns in self.store.coldest(64):
                if free >= self.low_bytes:
                    break
                if flags & 1 and self.store.evict_spilled(key):
                    free += size
                    did["evicted"] += 1
                    progressed = True
            if not progressed:
                break
        return did

    def spill_all(self) -> int:
        """Spill every evictable chunk not on disk yet (flush / move-to-disk)."""
        n = 0
        if self.disk is None:
            return 0
        for key, _size, flags, ns in self.store.coldest(1 << 30):
            if not flags & 1:
                n += self.spill(key, ns)
        return n

    def spill(self, key: bytes, ns: bytes) -> int:
        """Write one shared-tier chunk to disk and mark it spilled; 1 if written."""
        assert self.disk is not None
        if self.disk.contains([key])[0]:
            self.store.mark_spilled(key)
            return 0
        leases = self.store.acquire_prefix([key], count_lookup=False)
        if not leases:
            return 0  # evicted or deleted meanwhile
        lease = leases[0]
        try:
            ok = self.disk.write(key, ns, lease.view())
        finally:
            valid = lease.release(cold=True)
        if ok and valid:
            self.store.mark_spilled(key)
            if self.remote is not None:
                self.remote.enqueue(key, ns)
            return 1
        if ok and not valid:
            self.disk.remove(key)  # the bytes may have been reused under us
        return 0


def promote(store: Store, disk: DiskTier | None, keys: Sequence[bytes], *, remote=None,
            namespaces: Sequence[bytes] | None = None, deadline_s: float | None = None) -> int:
    """Read chunks from disk (or, failing that, the remote tier; `namespaces`
    gives each key's) into the shared tier, in prefix order, stopping at the
    first that is missing, damaged or does not fit, or when `deadline_s`
    seconds have passed. Returns how many of `keys` are in the shared tier
    afterwards (a prefix)."""
    t_end = None if deadline_s is None else time.monotonic() + deadline_s
    n = 0
    for i, key in enumerate(keys):
        if store.contains([key])[0]:
            n += 1
            continue
        if t_end is not None and time.monotonic() > t_end:
            break
        got = disk.read_with_namespace(key) if disk is not None else None
        source = "disk"
        if got is None and remote is not None and namespaces is not None:
            got, source = remote.read_with_namespace(key, namespaces[i]), "remote"
        if got is None:
            break
        raw, ns = got
        r = store.put(key, raw, namespace=ns)
        if r not in (PutResult.OK, PutResult.EXISTS):
            store.bump("promote_errors")
            break
        if source == "disk":
            store.mark_spilled(key)  # a copy is on disk: evicting it loses nothing
        store.bump("disk_hits" if source == "disk" else "remote_hits")
        store.bump("promote_bytes", len(raw))
        n += 1
    return n


class MaintainerRole:
    """Background thread of a process that may maintain the cache: it takes
    the maintainer lock when it is free (at start, or when the holder exits)
    and then runs maintenance passes. An embedded role (a vLLM process,
    `yield_to_daemon`) hands the role over as soon as a daemon runs for the
    cache, and stays in standby while one does."""

    def __init__(self, cfg, store: Store, disk: DiskTier | None, *, interval_s: float = 0.05,
                 standby_s: float = 1.0, yield_to_daemon: bool = True, remote=None) -> None:
        self.lock = MaintainerLock(cfg.cache_name)
        self.daemon = DaemonLock(cfg.cache_name) if yield_to_daemon else None
        self.maintainer = Maintainer(store, disk, low_watermark=cfg.low_watermark, spill_ahead=cfg.spill_ahead,
                                     remote=remote)
        self.disk = disk
        self.interval_s = interval_s
        self.standby_s = standby_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="shmkv-maintainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.lock.release()

    def _daemon_runs(self) -> bool:
        return self.daemon is not None and self.daemon.is_held_elsewhere()

    def _loop(self) -> None:
        next_daemon_check = 0.0
        while not self._stop.is_set():
            if not self.lock.held:
                if self._daemon_runs() or not self.lock.try_acquire():
                    self._stop.wait(self.standby_s)
                    continue
                log.info("shmkv: this process (pid %d) is now the cache maintainer", os.getpid())
                if self.disk is not None:
                    files, size = self.disk.rebuild_index()
                    log.info("shmkv: disk tier index rebuilt: %d chunks, %.1f MiB", files, size / 2**20)
            elif time.monotonic() >= next_daemon_check:
                next_daemon_check = time.monotonic() + self.standby_s
                if self._daemon_runs():
                    log.info("shmkv: the daemon (pid %s) runs: handing it the maintainer role",
                             self.daemon.holder_pid() if self.daemon else "?")
                    self.lock.release()
                    continue
            try:
                self.maintainer.run_once()
            except Exception:
                log.exception("shmkv: maintenance pass failed; retrying")
            self._stop.wait(self.interval_s)
