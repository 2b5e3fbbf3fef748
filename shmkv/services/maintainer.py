"""The maintainer role: exactly one process per cache keeps the shared tier
healthy, off vLLM's hot path.

  * spill ahead: the coldest evictable chunks (up to `spill_ahead` of the
    arena) are written to the disk tier before anyone needs their memory, so
    an eviction by a put rarely loses a chunk (`evicted_unspilled` counts it
    when it does);
  * watermark: when free space drops below `low_watermark`, spilled chunks
    are evicted from the cold end until it is back above it, so puts rarely
    find the tier full and never wait for disk I/O;
  * spill guard: while its spills reach the disk, the maintainer renews a
    guard in the segment (SPILL_GUARD_S): puts then evict only chunks
    already on disk, and when writes outrun the disk the newest put answers
    FULL (counted put_spill_behind; one WARNING names the write and spill
    rates) instead of evicting a chunk the disk never got. The newest gives
    because nothing waits for it (not vLLM's forward, not a store thread
    holding blocks) and it is the one still recomputable; a failing disk
    (backoff) or a stopped maintainer lets the guard lapse, and puts evict
    from the LRU tail again (evicted_unspilled);
  * reclaim: leases and half-written chunks of dead processes are released;
  * size: a segment file somebody truncated is grown back and reset before
    any page past the cut is touched (that would be SIGBUS).

A spill that fails (full disk, I/O error) leaves the chunk in memory and
starts a backoff (0.25 s doubling to 30 s) during which passes do not try
again; one WARNING says when spilling starts failing and one INFO when it
works again, with the number of failures in between. A disk that was full
and has room again (statvfs, read every pass) ends the backoff at once: the
guard is back within a pass, not after up to 30 s of puts evicting chunks
the disk could take.

The role is an exclusive flock on <runtime dir>/<cache>.maintainer.lock (shmkv.paths) and,
because containers share the segment but not the runtime directory, the
segment's own maintainer role (Store.try_hold_role: an OFD lock the kernel
drops when the holder dies, in any PID namespace): the daemon takes it when
it runs (an embedded holder hands it over within a second, also when the
daemon runs in another container); without a daemon, the first vLLM
scheduler process to get it does the work in a background thread, and
another takes over when it exits.

Promotion (disk -> shared tier) is not the maintainer's: the process that
found a disk hit promotes it (shmkv.tiers.TierChain.promote), so a lookup
never waits on another process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from shmkv.backoff import Backoff
from shmkv.config import io_threads
from shmkv.errors import LockTimeoutError, SegmentCorruptError
from shmkv.paths import daemon_lock, maintainer_lock
from shmkv.store import FLAG_SPILLED, Role
from shmkv.tiers import Spill, TierChain
from shmkv.tiers.disk.tier import DiskTier

log = logging.getLogger("shmkv.maintainer")

SPILL_GUARD_S = 2.0  # the guard's lease, renewed by every pass (a pass runs every 50 ms)
BEHIND_QUIET_S = 60.0  # refusals after this long without any start a new episode (a new WARNING)


class _SpillBehindWatch:
    """One WARNING per episode of puts refused by the spill guard, naming
    the rates: the shared tier's committed bytes and the disk tier's spilled
    bytes per second since the previous pass that saw no refusal."""

    def __init__(self) -> None:
        self._base: tuple[float, int, int] | None = None  # (time, put_bytes, spill_bytes) before refusals
        self._refused = 0
        self._last_refusal = 0.0

    def see(self, st: dict[str, int]) -> None:
        now = time.monotonic()
        refused = st.get("put_spill_behind", 0)
        quiet = now - self._last_refusal > BEHIND_QUIET_S
        if self._base is None or refused == self._refused:
            if self._base is None or quiet:
                self._base = (now, st.get("put_bytes", 0), st.get("spill_bytes", 0))  # rates measured from here
            self._refused = refused
            return
        new, self._refused, self._last_refusal = refused - self._refused, refused, now
        if not quiet:
            return
        t0, put0, spill0 = self._base
        dt = max(now - t0, 1e-3)
        log.warning("shmkv: writes outrun the disk tier: %.0f MB/s committed to the shared tier, %.0f MB/s "
                    "spilled to disk over the last %.1f s; %d put(s) refused so far (put_spill_behind) so that no "
                    "chunk leaves memory before it is on disk. Faster disks, more io_threads or a larger "
                    "capacity raise the pace the cache keeps", (st.get("put_bytes", 0) - put0) / dt / 1e6,
                    (st.get("spill_bytes", 0) - spill0) / dt / 1e6, dt, new)


class Maintainer:
    def __init__(self, chain: TierChain, *, low_watermark: float = 0.10, spill_ahead: float = 0.20,
                 threads: int = 1) -> None:
        """The tiers are the chain's: spills go through it (disk, then queued
        for remote). `threads`: chunks spilled at once (encoding runs without
        the GIL)."""
        self.chain = chain
        self.store = store = chain.store
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shmkv-spill") if self.threads > 1 else None
        self.disk: DiskTier | None = chain.disk
        arena = store.arena_bytes
        self.low_bytes = int(arena * low_watermark)
        self.spill_ahead_bytes = int(arena * spill_ahead)
        self.backoff = Backoff()  # of spills: a full disk is not retried at once
        self._behind = _SpillBehindWatch()

    # ------------------------------------------------------------- steps --
    def run_once(self) -> dict[str, int]:
        """One maintenance pass; returns what it did."""
        did = {"spilled": 0, "evicted": 0, "reclaimed": 0}
        if not self.store.check_size():
            did["restored"] = 1
        r = self.store.reclaim()
        did["reclaimed"] = r["leases"] + r["writes"]
        if self.disk is None:
            return did
        st = self.store.stats()
        self._behind.see(st)
        if not self.backoff.ready() and self.disk.room_returned():
            # NOTE: a disk freed mid-backoff (up to 30 s) would leave the guard lapsed all that while,
            # and puts would evict chunks the disk could now take
            log.info("shmkv: %s has room again: spilling resumes", self.disk.dir)
            self.backoff.retry_now()
        self._renew_guard()
        free = st["arena_bytes"] - st["bytes_used"]
        budget = self.spill_ahead_bytes + max(0, self.low_bytes - free)
        covered = 0
        todo: list[tuple[bytes, bytes]] = []
        for key, size, flags, ns, _tokens in self.store.coldest(4096):
            if covered >= budget:
                break
            covered += size
            if not flags & FLAG_SPILLED:
                todo.append((key, ns))
        did["spilled"] += self._spill_many(todo, respect_backoff=True)
        # evict spilled chunks from the cold end until above the low watermark
        while free < self.low_bytes:
            progressed = False
            for key, size, flags, _ns, _tokens in self.store.coldest(64):
                if free >= self.low_bytes:
                    break
                if flags & FLAG_SPILLED and self.store.evict_spilled(key):
                    free += size
                    did["evicted"] += 1
                    progressed = True
            if not progressed:
                break
        return did

    def spill_all(self) -> tuple[int, int]:
        """Spill every chunk of the shared tier not on disk yet (flush), now,
        whatever the backoff. Returns (spilled now, still not on disk)."""
        if self.disk is None:
            return 0, 0
        def unspilled() -> list[dict]:  # pinned chunks stay in memory only, by design
            return [e for e in self.store.entries()
                    if e["state"] == "ready" and not e["pins"] and not e["flags"] & FLAG_SPILLED]

        n = self._spill_many([(e["key"], e["namespace"]) for e in unspilled()], respect_backoff=False)
        return n, len(unspilled())

    def _spill_many(self, items: list[tuple[bytes, bytes]], *, respect_backoff: bool) -> int:
        """Spill (key, namespace) items coldest first, up to `threads` at once;
        with `respect_backoff` no new spill starts while spilling backs off."""
        n = 0
        inflight: set[Future] = set()
        for key, ns in items:
            self._renew_guard()  # a long pass (GiBs to spill) must not let it lapse while spills work
            if respect_backoff and not self.backoff.ready():
                break
            if self._pool is None:
                n += self.spill(key, ns)
                continue
            if len(inflight) >= self.threads:
                done, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                n += sum(f.result() for f in done)
            inflight.add(self._pool.submit(self.spill, key, ns))
        return n + sum(f.result() for f in inflight)

    def _renew_guard(self) -> None:
        """The spill guard, while spills work (module doc): it lapses by itself if they stop."""
        if self.disk is not None and self.backoff.ready():
            self.store.renew_spill_guard(SPILL_GUARD_S)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def spill(self, key: bytes, ns: bytes) -> int:
        """Spill one shared-tier chunk through the chain (disk, then queued for
        remote), minding the backoff's log lines; 1 if written now."""
        assert self.disk is not None
        got = self.chain.spill(key, ns)
        if got in (Spill.SPILLED, Spill.RACED):  # the write worked
            failures = self.backoff.worked()
            if failures:
                log.info("shmkv: spilling to %s works again (after %d failed attempts)", self.disk.dir, failures)
        elif got is Spill.FAILED and self.backoff.failed():
            log.warning("shmkv: spilling to %s fails (%s); chunks stay in memory only, retrying with a backoff "
                        "up to %.0f s", self.disk.dir, self.disk.last_write_error or "unknown error",
                        Backoff.MAX_S)
        return int(got is Spill.SPILLED)


class MaintainerRole:
    """Background thread of a process that may maintain the cache: it takes
    the maintainer lock when it is free (at start, or when the holder exits)
    and then runs maintenance passes. An embedded role (a vLLM process,
    `yield_to_daemon`) hands the role over as soon as a daemon runs for the
    cache, and stays in standby while one does."""

    def __init__(self, cfg, chain: TierChain, *, interval_s: float = 0.05, standby_s: float = 1.0,
                 yield_to_daemon: bool = True) -> None:
        self.lock = maintainer_lock(cfg.cache_name)
        self.daemon = daemon_lock(cfg.cache_name) if yield_to_daemon else None
        self.maintainer = Maintainer(chain, low_watermark=cfg.low_watermark, spill_ahead=cfg.spill_ahead,
                                     threads=io_threads(cfg))
        self.disk = self.maintainer.disk
        self.interval_s = interval_s
        self.standby_s = standby_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = ""  # the failure the last pass ended with, logged once

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="shmkv-maintainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.maintainer.close()
        self._release()

    def _daemon_runs(self) -> bool:
        if self.daemon is None:
            return False
        return self.daemon.is_held_elsewhere() or self.maintainer.store.role_held_elsewhere(Role.DAEMON)

    def _acquire(self) -> bool:
        """The role in this runtime directory and across every container that shares the segment."""
        store = self.maintainer.store
        if not store.try_hold_role(Role.MAINTAINER):
            return False
        if not self.lock.try_acquire():
            store.release_role(Role.MAINTAINER)
            return False
        return True

    def _release(self) -> None:
        self.lock.release()
        if not self.maintainer.store.closed:
            self.maintainer.store.renew_spill_guard(0)  # no spills from here on: puts evict as before
            self.maintainer.store.release_role(Role.MAINTAINER)

    def _loop(self) -> None:
        next_daemon_check = 0.0
        while not self._stop.is_set():
            if not self.lock.held:
                if self._daemon_runs() or not self._acquire():
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
                             (self.daemon.holder_pid() if self.daemon else None) or "in another container")
                    self._release()
                    continue
            try:
                self.maintainer.run_once()
                if self._failing:
                    log.info("shmkv: maintenance works again (after %s)", self._failing)
                    self._failing = ""
            except Exception as e:
                # One line per kind of failure, not one per pass (a pass runs every 50 ms).
                kind = type(e).__name__  # not the message: it may hold a changing duration
                if kind != self._failing:
                    if isinstance(e, (LockTimeoutError, SegmentCorruptError)):
                        log.warning("shmkv: maintenance paused: %s", e)
                    else:
                        log.exception("shmkv: maintenance pass failed; retrying")
                    self._failing = kind
            self._stop.wait(self.interval_s)
