"""The shared-memory chunk store: a typed Python face over shmkv._C.

One `Store` is one process's attachment to a named POSIX shared-memory segment
(/dev/shm/<name>, mode 0600). Every vLLM process on the host attaches the same
segment, so a chunk one process commits is readable by all.

Two-phase operations, never a payload copy under the table lock:

    r = store.reserve(key, nbytes)          # Reservation, or a PutResult
    if isinstance(r, Reservation):
        with r:                              # commit on success, abort on error
            r.view()[:] = payload
    with store.acquire(key) as lease:        # None on a miss
        data = lease.numpy(np.uint16)        # zero-copy, read-only

A new segment reserves its metadata and a first part of its arena (256 MiB)
before it is handed out, and the rest in the background (a thread of every
process that opens it while some is left; a process that dies midway leaves
the rest to the next): the allocator never hands out bytes whose pages are not
reserved, so creation takes a fraction of a second whatever the capacity.

"Miss" (None), "full", "exists" and "busy" (PutResult) are ordinary results.
Errors raise from the hierarchy in shmkv.errors. Keys are 16-byte `bytes`
(see shmkv.keys).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shmkv import _C
from shmkv.errors import InvalidArgumentError, PayloadTooLargeError, PermissionDeniedError, StoreInUseError
from shmkv.store.handles import DEFERRED_ABORTS, Lease, Reservation, retry_deferred_aborts
from shmkv.store.results import (
    FLAG_COMPRESSED,
    FLAG_SPILLED,
    PRESENCE_OF,
    READ_RESULT_OF,
    Key,
    Keys,
    OpenOutcome,
    Presence,
    PutResult,
    ReadResult,
    Role,
    Status,
    raise_if_error,
    raise_status,
)
from shmkv.units import format_bytes

log = logging.getLogger("shmkv.store")

_MODE_CREATE, _MODE_ATTACH, _MODE_OPEN_OR_CREATE = 0, 1, 2
LOCK_TIMEOUT_S = _C.LIMITS["lock_timeout_s"]  # [min, max] seconds: the core's bounds (cpp/value_limits.h)
DEFAULT_LOCK_TIMEOUT_S = _C.LIMITS["lock_timeout_default_s"]  # the core's default, the setting's too
CLOSE_WAIT_S = 5.0  # bound of close()'s wait for this attachment's open leases and reservations
INIT_WAIT_S = 120.0  # bound of the wait for another process initialising the segment (Store.create/attach)
# Stores whose background reserver may still run. At interpreter exit each is
# stopped and joined first: a daemon thread still inside the C++ core when the
# interpreter finalises would end the process with std::terminate (SIGABRT).
_RESERVING: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _stop_reservers_at_exit() -> None:
    for store in list(_RESERVING):
        store._stop_reserver()


RESERVE_STEP = 256 << 20  # arena bytes the background reserver reserves (and maps) per call


@dataclass(frozen=True)
class SegmentGeometry:
    """How a segment is laid out. capacity_bytes is the exact size of the
    segment; payloads live in what is left after the metadata (arena_bytes).
    Zero means "derive a default"."""

    capacity_bytes: int
    max_payload_bytes: int = 0  # default: a quarter of the arena
    alignment: int = 4096
    max_entries: int = 0  # default: capacity / 32 KiB, clamped to [1024, 2M]
    max_leases: int = 0  # default: 2 * max_entries, clamped to [4096, 4M]
    max_procs: int = 256

    def resolved(self) -> dict[str, int]:
        """The geometry the C++ core would build, or raise InvalidArgumentError."""
        self.check()
        code, msg, geo = _C.geometry(
            self.capacity_bytes, self.max_payload_bytes, self.alignment,
            self.max_entries, self.max_leases, self.max_procs,
        )
        if code:
            raise_status(code, msg)
        return dict(geo)

    def check(self) -> None:
        """InvalidArgumentError naming the first field that is not a usable integer."""
        limits = {"capacity_bytes": (1, 1 << 62), "max_payload_bytes": (0, 1 << 62), "alignment": (1, 1 << 30),
                  "max_entries": (0, (1 << 32) - 1), "max_leases": (0, (1 << 32) - 1),
                  "max_procs": (1, (1 << 32) - 1)}
        for name, (lo, hi) in limits.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidArgumentError(f"{name}={v!r}: expected an integer in [{lo}, {hi}]")


def default_cache_name() -> str:
    """The cache name used when none is configured: one per user."""
    return f"shmkv-{os.getuid()}"



_checked_segment_dirs: set[str] = set()
_pages_said: set[str] = set()


def _say_page_size(where: str) -> None:
    """One log line per process and segment directory `where`, from a process
    that makes a segment: the page size its segments get (shmkv.hostmem), and
    how to get huge pages where they are 4 KiB."""
    from shmkv.hostmem import segment_pages

    if where in _pages_said:
        return
    _pages_said.add(where)
    pages = segment_pages(where)
    if pages.huge:
        log.info("shmkv: segments in %s get huge pages (%s)", where, pages.how)
    else:
        log.info("shmkv: segments in %s get 4 KiB pages (%s); a tmpfs mounted with huge=within_size gives huge "
                 "pages (fewer to pin for a GPU): `shmkv check` says more", where, pages.how)


def _check_segment_dir_parents(where: str) -> None:
    """The segment directory's parents must be ones no other user can change
    (the directory itself the core checks: ours, 0700, a tmpfs): otherwise
    another user could swap a parent and point us at another directory
    between two opens. Once per process and directory."""
    from shmkv.paths import check_trusted_dir

    if not where or where in _checked_segment_dirs or not os.path.isabs(where):
        return  # unset: POSIX shm; relative: the core refuses it, naming it
    try:
        check_trusted_dir(os.path.dirname(os.path.normpath(where)) or "/")
    except PermissionDeniedError as e:
        raise PermissionDeniedError(f"segment_dir={where}: {e}") from None
    _checked_segment_dirs.add(where)

class Store:
    """One process's attachment to a shmkv shared-memory segment.

    Use Store.create / Store.attach / Store.open_or_create. Thread-safe: every
    operation takes the segment's process-shared lock (the GIL is released
    while waiting for it).
    """

    def __init__(self, table: Any, outcome: OpenOutcome, segment_dir: str) -> None:
        self._t = table
        self.outcome = outcome
        self.name: str = table.name
        self.segment_dir = segment_dir  # "" = POSIX shm (/dev/shm)
        self._reserver: threading.Thread | None = None
        self._stop_reserving = threading.Event()
        self._reserve_ended = threading.Event()

    # ------------------------------------------------------------ opening --
    @classmethod
    def _open(cls, name: str, mode: int, geometry: SegmentGeometry, populate: bool,
              lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, init_wait_s: float = INIT_WAIT_S,
              background_reserve: bool = True, segment_dir: str | None = None) -> Store:
        from shmkv.names import segment_dir_or_default, segments_dir

        where = segment_dir_or_default(segment_dir)
        g = geometry
        g.check()
        if isinstance(lock_timeout_s, bool) or not isinstance(lock_timeout_s, (int, float)) \
                or not LOCK_TIMEOUT_S[0] <= lock_timeout_s <= LOCK_TIMEOUT_S[1]:
            raise InvalidArgumentError(f"lock_timeout_s={lock_timeout_s!r}: expected seconds in "
                                       f"[{LOCK_TIMEOUT_S[0]:g}, {LOCK_TIMEOUT_S[1]:g}]")
        _check_segment_dir_parents(where)
        code, msg, table, outcome = _C.open_table(
            name, where, mode, g.capacity_bytes, g.max_payload_bytes, g.alignment,
            g.max_entries, g.max_leases, g.max_procs, populate, float(lock_timeout_s), float(init_wait_s),
        )
        if code:
            raise_status(code, msg)
        store = cls(table, OpenOutcome(outcome), where)
        if store.outcome is not OpenOutcome.ATTACHED:  # whoever makes (or remakes) the segment says its pages
            _say_page_size(segments_dir(where))
        st = table.stats()
        if background_reserve and st["arena_reserved_bytes"] < st["arena_bytes"]:
            store._reserver = threading.Thread(target=store._reserve_rest, args=(populate,),
                                               name="shmkv-reserve", daemon=True)
            store._reserver.start()
            _RESERVING.add(store)
        log.debug(
            "%s shared-memory segment '%s': capacity %s, payload arena %s, max payload %s, "
            "%d entries max",
            {0: "created", 1: "attached", 2: "re-initialised stale", 3: "adopted stale"}[outcome],
            name, format_bytes(st["capacity_bytes"]), format_bytes(st["arena_bytes"]),
            format_bytes(st["max_payload_bytes"]), st["max_entries"],
        )
        return store

    @classmethod
    def create(cls, name: str, capacity_bytes: int, *, populate: bool = True,
               lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, init_wait_s: float = INIT_WAIT_S,
               background_reserve: bool = True, segment_dir: str | None = None, **geometry: int) -> Store:
        """Create a fresh, empty segment. A stale one (no live process
        attached) is re-initialised; a live one raises SegmentExistsError.
        `lock_timeout_s` bounds every wait for the table lock (module doc);
        `init_wait_s` the wait for another process initialising the segment
        (then LockTimeoutError naming it); `background_reserve`: reserve
        the rest of the arena in a thread of this process (module doc; off:
        only the first part is usable until someone calls reserve_more).
        `segment_dir`: the directory the segment lives in, "" for POSIX shm
        (/dev/shm); None: the segment_dir setting of this process's
        environment (SHMKV_SEGMENT_DIR). The same for every opener below."""
        return cls._open(name, _MODE_CREATE, SegmentGeometry(capacity_bytes, **geometry), populate,
                         lock_timeout_s, init_wait_s, background_reserve, segment_dir)

    @classmethod
    def attach(cls, name: str, *, populate: bool = True, lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
               init_wait_s: float = INIT_WAIT_S, background_reserve: bool = True,
               segment_dir: str | None = None) -> Store:
        """Attach to an existing segment, live or stale, whatever its geometry
        (read from it; a stale one is adopted with its chunks). Raises
        SegmentNotFoundError or SegmentMismatchError (nothing written)."""
        return cls._open(name, _MODE_ATTACH, SegmentGeometry(1 << 20), populate, lock_timeout_s, init_wait_s,
                         background_reserve, segment_dir)

    @classmethod
    def open_or_create(cls, name: str, capacity_bytes: int, *, populate: bool = True,
                       lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S, init_wait_s: float = INIT_WAIT_S,
                       background_reserve: bool = True, segment_dir: str | None = None,
                       **geometry: int) -> Store:
        """Attach if a segment with this geometry exists, else create it. A
        live segment with another geometry raises SegmentMismatchError naming
        the differences; a stale one is adopted if it matches (its chunks
        survive), else re-initialised."""
        return cls._open(name, _MODE_OPEN_OR_CREATE, SegmentGeometry(capacity_bytes, **geometry),
                         populate, lock_timeout_s, init_wait_s, background_reserve, segment_dir)

    @staticmethod
    def unlink(name: str, *, missing_ok: bool = True, segment_dir: str | None = None) -> bool:
        """Remove the segment's name (in `segment_dir`, as for create).
        Attached processes keep their mapping."""
        from shmkv.names import segment_dir_or_default

        code, msg = _C.unlink(name, segment_dir_or_default(segment_dir))
        if code == Status.NOT_FOUND and missing_ok:
            return False
        if code:
            raise_status(code, msg)
        return True

    def close(self, *, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Detach this process (the mapping goes when the last view does).

        Leases and reservations of this attachment still open (a copy in
        flight on another thread) are waited for up to `timeout_s`; then
        StoreInUseError, and the store stays attached: detaching would let
        other processes reclaim them as a dead holder's while a late copy
        still writes or reads through them."""
        if self._t is None:
            return
        deadline = time.monotonic() + timeout_s
        while (n := self._t.open_handles()) > 0:
            if time.monotonic() >= deadline:
                raise StoreInUseError(
                    f"cannot close shmkv store '{self.name}': {n} lease(s) or reservation(s) of this process are "
                    f"still open after {timeout_s:g} s; release, commit or abort them (or finish the copies using "
                    "them) first. The store stays attached")
            time.sleep(0.005)
        self._stop_reserver()
        self._t.detach()
        self._t = None

    def _stop_reserver(self) -> None:
        if self._reserver is not None:
            self._stop_reserving.set()
            self._reserver.join()  # at most one step (RESERVE_STEP bytes)
            self._reserver = None
        _RESERVING.discard(self)

    def _reserve_rest(self, map_pages: bool) -> None:
        """Background: reserve the rest of the arena step by step (each step
        usable at once), until it is all reserved, /dev/shm refuses, or
        close(); then, with map_pages, map it into this process."""
        t0 = time.perf_counter()
        t = self._t
        st = t.stats()
        arena, start = st["arena_bytes"], st["arena_reserved_bytes"]
        try:
            while not self._stop_reserving.is_set():
                code, msg, now = t.reserve_more(RESERVE_STEP, False)
                if code:
                    log.warning("shmkv: %s", msg)
                    return
                if now >= arena:
                    break
            else:
                return
        finally:
            self._reserve_ended.set()
        dt = time.perf_counter() - t0
        log.info("shmkv: segment '%s': the rest of its arena (%s) reserved in the background in %.2f s (%.2f GB/s)",
                 self.name, format_bytes(arena - start), dt, (arena - start) / max(dt, 1e-9) / 1e9)
        off = 0
        while map_pages and off < arena and not self._stop_reserving.is_set():
            if not t.map_arena(off, RESERVE_STEP):
                return  # no MADV_POPULATE_WRITE here: first touch maps the pages
            off += RESERVE_STEP

    def wait_reserved(self, timeout_s: float | None = None, *, mapped: bool = False) -> bool:
        """Wait (at most timeout_s) until this process's background
        reservation of the arena has ended (with `mapped`: and its mapping of
        the pages into this process, which follows); True if the whole arena
        is reserved."""
        reserver = self._reserver
        if reserver is not None:
            if mapped:
                reserver.join(timeout_s)
            else:
                self._reserve_ended.wait(timeout_s)
        st = self.stats()
        return st["arena_reserved_bytes"] >= st["arena_bytes"]

    def reserve_more(self, max_bytes: int, *, map_pages: bool = False) -> int:
        """Reserve up to `max_bytes` more of the arena's pages now (what the
        background reservation does step by step); returns the arena bytes
        reserved. Raises (e.g. NoSpaceError naming /dev/shm) when the pages
        cannot be had; the cache keeps working with the part reserved."""
        code, msg, now = self.table.reserve_more(int(max_bytes), bool(map_pages))
        if code:
            raise_status(code, msg)
        return int(now)

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._t is None

    @property
    def table(self) -> Any:
        if self._t is None:
            raise InvalidArgumentError(f"store '{self.name}' is closed")
        return self._t

    # ------------------------------------------------------------- stores --
    def reserve(self, key: Key, nbytes: int, *, namespace: bytes | None = None,
                tokens: int = 0, compressed: bool = False) -> Reservation | PutResult:
        """Room for `nbytes` under `key`, or FULL / EXISTS / BUSY. `namespace`
        (16 bytes, the chunk's namespace root key) tags the entry for the
        tiers and for clear(namespace=...); `tokens` (the prompt tokens the
        chunk holds) is counted at commit and by the tiers it spills to;
        `compressed`: the payload is an encoded chunk, not raw KV."""
        if nbytes <= 0:
            raise InvalidArgumentError(f"payload size must be > 0, got {nbytes}")
        if DEFERRED_ABORTS:
            retry_deferred_aborts()
        code, res = self.table.reserve(key, nbytes, namespace, tokens, FLAG_COMPRESSED if compressed else 0)
        if code == Status.OK:
            return Reservation(res, key)
        if code == Status.TOO_LARGE:
            raise PayloadTooLargeError(
                f"payload of {nbytes} bytes exceeds max_payload_bytes "
                f"{self.table.stats()['max_payload_bytes']} of segment '{self.name}'"
            )
        raise_if_error(code)
        return PutResult(code)

    def put(self, key: Key, data: Any, *, namespace: bytes | None = None, tokens: int = 0,
            compressed: bool = False) -> PutResult:
        """reserve + copy + commit of a C-contiguous buffer (bytes, numpy...)."""
        code = self.table.put(key, data, namespace, tokens, FLAG_COMPRESSED if compressed else 0)
        if code == Status.TOO_LARGE:
            raise PayloadTooLargeError(f"payload exceeds max_payload_bytes of segment '{self.name}'")
        if code == Status.INVALID_ARGUMENT:
            raise InvalidArgumentError("payload must be non-empty")
        raise_if_error(code)
        return PutResult(code)

    # -------------------------------------------------------------- loads --
    def acquire(self, key: Key) -> Lease | None:
        """A read lease on `key`, or None on a miss."""
        c = self.table.acquire(key)
        return None if c is None else Lease(c)

    def acquire_prefix(self, keys: Keys, *, count_lookup: bool = True) -> list[Lease]:
        """Leases on the longest cached prefix of `keys` (one lock)."""
        return [Lease(c) for c in self.table.acquire_prefix(keys, count_lookup)]

    def get(self, key: Key) -> bytes | None:
        """A copy of the payload, or None on a miss."""
        lease = self.acquire(key)
        if lease is None:
            return None
        with lease:
            data = bytes(lease.view())
        return data

    def get_into(self, key: Key, out: Any) -> int | None:
        """Copy the payload into a writable buffer; bytes copied, or None on a
        miss (also when the lease went stale during the copy)."""
        n = self.table.get_into(key, out)
        return None if n < 0 else n

    def lookup_prefix(self, keys: Keys, *, count_lookup: bool = True) -> int:
        """How many leading keys are cached (one lock, no leases)."""
        return self.table.lookup_prefix(keys, count_lookup)

    def contains(self, keys: Keys) -> list[bool]:
        """For each key, whether it is cached (committed)."""
        return [b == 1 for b in self.table.contains(keys)]

    def presence(self, keys: Keys) -> list[Presence]:
        """For each key: READY, WRITING (a writer has reserved it and not
        committed yet) or ABSENT; one lock, no leases."""
        return [PRESENCE_OF[b] for b in self.table.contains(keys)]

    def read_chunks(self, keys: Keys, out: Any, offsets: Sequence[int], size: int) -> list[ReadResult]:
        """Copy each key's payload, which must be exactly `size` raw bytes,
        into the writable buffer `out` at its offset (acquire, copy without
        the GIL, release, per key); what happened to each."""
        import numpy as np

        offs = np.ascontiguousarray(offsets, dtype=np.uint64)
        return [READ_RESULT_OF[c] for c in self.table.read_chunks(keys, out, offs, int(size))]

    def write_chunks(self, keys: Keys, src: Any, offsets: Sequence[int], size: int, *,
                     namespace: bytes | None = None, tokens: int = 0) -> list[PutResult]:
        """Store src[offsets[i] : offsets[i] + size] under keys[i] (reserve,
        copy without the GIL, commit, per key); `namespace` and `tokens` as
        in reserve(); what happened to each."""
        if size <= 0:
            raise InvalidArgumentError(f"payload size must be > 0, got {size}")
        max_payload = self.table.stats()["max_payload_bytes"]
        if size > max_payload:
            raise PayloadTooLargeError(f"payload of {size} bytes exceeds max_payload_bytes {max_payload} "
                                       f"of segment '{self.name}'")
        import numpy as np

        offs = np.ascontiguousarray(offsets, dtype=np.uint64)
        codes = self.table.write_chunks(keys, src, offs, int(size), namespace, tokens)
        for c in codes:
            raise_if_error(c)
        return [PutResult(c) for c in codes]

    # --------------------------------------------------------- management --
    def pin(self, key: Key) -> bool:
        """Never evict `key` until unpin(); False on a miss. Pins nest."""
        return self.table.pin(key) == Status.OK

    def unpin(self, key: Key) -> bool:
        return self.table.unpin(key) == Status.OK

    def delete(self, key: Key) -> bool:
        """Remove `key`; True if it was cached. A leased chunk disappears now
        and its bytes are freed at the last release."""
        return self.table.erase(key) in (PutResult.OK.value, PutResult.BUSY.value)

    def clear(self, *, namespace: bytes | None = None) -> int:
        """Remove every cached chunk (or those of one namespace); returns how many."""
        return int(self.table.clear(namespace))

    def reclaim(self) -> dict[str, int]:
        """Release leases and unfinished writes of processes that exited
        (judged by the locks their slots hold: in any PID namespace)."""
        return dict(self.table.reclaim())

    # ------------------------------------------- roles across containers --
    def try_hold_role(self, role: Role) -> bool:
        """Take `role` among every process of every PID namespace sharing this
        segment (an OFD lock of the segment file: the kernel drops it when this
        process dies or the store closes); never waits."""
        return bool(self.table.try_hold_role(role.value))

    def release_role(self, role: Role) -> None:
        self.table.release_role(role.value)

    def role_held_elsewhere(self, role: Role) -> bool:
        """Whether another process (or another store of this one) holds `role`."""
        return bool(self.table.role_held_elsewhere(role.value))

    # -------------------------------------------------- tier maintenance --
    def coldest(self, max_n: int) -> list[tuple[bytes, int, int, bytes, int]]:
        """(key, size, flags, namespace, tokens) of the next eviction victims, coldest first."""
        return self.table.coldest(max_n)

    def mark_spilled(self, key: Key) -> bool:
        return self.table.set_flags(key, FLAG_SPILLED) == Status.OK

    def evict_spilled(self, key: Key) -> bool:
        """Evict `key` if it is spilled and nobody leases or pins it."""
        return self.table.evict_spilled(key) == Status.OK

    def renew_spill_guard(self, seconds: float) -> None:
        """The maintainer, while its spills reach the disk: for `seconds`,
        puts evict only chunks already on disk (0: lift it now)."""
        self.table.renew_spill_guard(float(seconds))

    def spill_guard_active(self) -> bool:
        return self.table.spill_guard_active()

    def bump(self, counter: str, n: int = 1) -> None:
        """Add to a shared tier counter (spills, disk_hits, disk_damaged...)."""
        self.table.bump(counter, n)

    def rebuild(self) -> None:
        """Rebuild every derived structure from the authoritative records."""
        self.table.rebuild()

    def entries(self) -> list[dict[str, Any]]:
        """Every record in use: key, namespace, size, alloc_size, state
        ("writing", "ready", or "doomed": erased while leased), pins, leases, flags, owner_pid, tokens (one lock)."""
        return list(self.table.list_entries())

    def check_consistency(self) -> list[str]:
        """Problems found by a full consistency check (empty when sound)."""
        return list(self.table.check_consistency())

    def stats(self) -> dict[str, int]:
        """Counters and gauges of the segment (shared by all processes). Never
        waits for the table lock; `lock_holder_pid` / `lock_held_ms` name who
        holds it now."""
        return dict(self.table.stats())

    def removal_count(self) -> int:
        """A count that moves whenever a chunk may have left the segment
        (evictions + deletes + resets; one read, no lock, no dict)."""
        return int(self.table.removal_count())

    def lock_holder(self) -> tuple[int, float]:
        """(pid, seconds held) of the process holding the table lock; pid 0: nobody."""
        pid, held = self.table.lock_holder()
        return int(pid), float(held)

    def lock_available(self) -> bool:
        """Whether the table lock can be had within the bound (it is taken
        and given back at once)."""
        return bool(self.table.probe_lock())

    def check_size(self) -> bool:
        """Whether the segment file still has its full size. If somebody
        truncated it, grow it back, reset the table (what was past the cut is
        lost; counted as segment_truncated) and return False. Touching pages
        past the end of a truncated file raises SIGBUS, so the maintainer calls
        this before each pass."""
        # NOTE: read nothing of the segment before the size is known good (SIGBUS past the end)
        if self.table.file_bytes() >= self.table.capacity_bytes:
            return True
        have = self.table.file_bytes()
        log.error("shmkv: segment '%s' file was truncated to %d bytes (a process of this user did it); "
                  "restoring its size and resetting the cache", self.name, have)
        code, msg = self.table.restore_size()
        raise_if_error(code, msg)
        return False

    @property
    def arena_address(self) -> int:
        return int(self.table.arena_address)

    @property
    def arena_bytes(self) -> int:
        return int(self.table.arena_bytes)

    @property
    def max_payload_bytes(self) -> int:
        """The largest payload one chunk of this segment may have."""
        return int(self.table.max_payload_bytes)

    def __repr__(self) -> str:
        return f"Store(name={self.name!r}, outcome={self.outcome.name})"

