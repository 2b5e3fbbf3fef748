"""The tier chain: shared memory -> disk -> remote, walked as one. It alone
moves chunks between tiers; every process builds it with open_tiers().

Every tier implements `Tier` with one signature and never touches another
tier (no tier imports another; the remote tier gets the bytes it writes
from the chain, through its `source` callback). The chain owns:

  * the prefix walk (`held_prefix`, keys only: the caller's chunker made
    them, shmkv.chunking.Chunker.cached_prefix): the longest prefix of a
    prompt's units that some tier holds, in prefix order: units 0..a from the
    shared tier, a..b from disk, b..c from remote; the first unit no tier
    holds ends it (later units are useless without it). A unit is held by a
    tier when that tier holds the key of every TP rank. `first_held` answers
    which of the tail-piece candidates a tier holds.
  * promotion (`promote`): units found below the shared tier are read from
    the first lower tier that has them and put into the shared tier, in
    prefix order, stopping at the first that cannot be (missing, damaged,
    no room) or at a deadline.
  * spill (`spill`: shared -> disk, then queued for remote), write-through
    (`write_through`: a committed chunk queued for remote), `flush` (disk
    synced, remote queue drained), `clear` and `close`.

Invariants: the shared tier is always first (loads come only from it); a
lower tier's miss, error or damage is a miss and a counter, never an
exception to the caller; nothing here holds the table lock across tiers.
"""
from __future__ import annotations

import enum
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from shmkv.chunking import Unit
from shmkv.names import DISK, RAW, REMOTE, SHM
from shmkv.store import PutResult, Store
from shmkv.tiers import format as fmt

log = logging.getLogger("shmkv.tiers")


class Spill(enum.Enum):
    """What TierChain.spill did with one chunk."""

    SPILLED = "spilled"  # written to disk (and queued for remote)
    ALREADY = "already"  # the disk tier held it: marked spilled
    GONE = "gone"  # no longer in the shared tier
    RACED = "raced"  # reclaimed while it was written: the file was removed
    FAILED = "failed"  # the disk write failed (full disk, I/O error): counted by the disk tier
    NO_DISK = "no_disk"


def kv_element_size(cfg: Any, kv_element_size: int | None = None) -> int:
    """The one rule for the byte-shuffle element size of encoded chunks:
    `disk_shuffle_bytes` when set, else the KV dtype's size when the caller
    knows it, else 2 (bf16/fp16)."""
    return int(cfg.disk_shuffle_bytes or kv_element_size or 2)


def open_tiers(cfg: Any, store: Store, *, kv_element_size_bytes: int | None = None, disk: bool = True,
               max_chunk_bytes: int | None = None) -> TierChain:
    """The tier chain a ShmkvConfig asks for: the shared tier, the disk tier
    (`disk_dir`; `disk=False`: a process that never reads or spills, a
    worker), the remote tier (`remote_url`). Every process builds its tiers
    here and nowhere else. `max_chunk_bytes`: the largest raw chunk this
    process can use (an engine's: its layout's chunk; default: the segment's
    largest payload); a stored chunk declaring more is refused unread."""
    from shmkv.config import io_threads
    from shmkv.tiers.disk import open_disk
    from shmkv.tiers.remote import open_remote

    es = kv_element_size(cfg, kv_element_size_bytes)
    lower = [open_disk(cfg, store=store, element_size=es) if disk else None,
             open_remote(cfg, store=store, element_size=es)]
    return TierChain(store, lower, threads=io_threads(cfg), write_through=bool(cfg.remote_write_through),
                     max_chunk_bytes=max_chunk_bytes)


class Tier(Protocol):
    """One level of the cache. `name` labels its counters ("<name>_hits")."""

    name: str

    def contains(self, keys: Sequence[bytes], namespaces: Sequence[bytes]) -> list[bool]:
        """For each (key, namespace): whether this tier holds it."""

    def fetch(self, key: bytes, namespace: bytes) -> tuple[bytes, bytes] | None:
        """(payload, namespace) of a checked chunk, or None (missing, damaged, unreachable)."""

    def fetch_into(self, key: bytes, namespace: bytes, alloc: Callable[[int, bytes], Any], *,
                   max_raw: int | None = None) -> tuple[Any, bytes] | None:
        """Like fetch, but decoded straight into alloc(raw_len, namespace)'s
        buffer: (that buffer, namespace), or None (missing, damaged, or alloc
        gave no buffer; what alloc gave is then the caller's to discard). A
        chunk whose header declares more than `max_raw` bytes is damaged
        (counted, removed) before anything is decompressed or allocated."""

    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview, tokens: int = 0) -> bool:
        """Store one chunk's payload (`tokens`: the prompt tokens it holds, for
        the put_tokens counters); False if it could not be (counted)."""

    def remove(self, key: bytes, namespace: bytes) -> bool:
        """Drop one chunk; False if it was not there."""

    def clear(self, namespace: bytes | None = None) -> int:
        """Drop every chunk (of one namespace); returns how many."""


class SharedTier:
    """The shared-memory segment as a Tier (plus the prefix lookup only it has)."""

    name = SHM

    def __init__(self, store: Store) -> None:
        self.store = store

    def contains(self, keys: Sequence[bytes], namespaces: Sequence[bytes] | None = None) -> list[bool]:
        return self.store.contains(keys)

    def fetch(self, key: bytes, namespace: bytes) -> tuple[bytes, bytes] | None:
        lease = self.store.acquire(key)
        if lease is None:
            return None
        with lease:
            raw = fmt.decode_or_none(lease.view(), key, lossy_ok=True) if lease.compressed else bytes(lease.view())
        return None if raw is None else (raw, namespace)

    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview, tokens: int = 0) -> bool:
        return self.store.put(key, raw, namespace=namespace, tokens=tokens) in (PutResult.OK, PutResult.EXISTS)

    def remove(self, key: bytes, namespace: bytes | None = None) -> bool:
        return self.store.delete(key)

    def clear(self, namespace: bytes | None = None) -> int:
        return self.store.clear(namespace=namespace)

    def prefix_length(self, units: Sequence[Unit], count: bool) -> int:
        """How many of `units` every rank holds, as a prefix (one batched
        lookup per rank; `count` counts rank 0's lookup in the hit stats)."""
        n = len(units)
        for r in range(len(units[0].keys) if units else 0):
            if n == 0:
                break
            n = min(n, self.store.lookup_prefix([u.keys[r] for u in units[:n]], count_lookup=count and r == 0))
        return n


class TierChain:
    """The shared tier and the tiers below it, in order."""

    def __init__(self, store: Store, lower: Sequence[Tier | None] = (), *, threads: int = 1,
                 write_through: bool = False, max_chunk_bytes: int | None = None) -> None:
        """`threads`: chunks fetched (read and decoded, without the GIL) at once
        when promoting; `write_through`: write_through() queues committed
        chunks for the remote tier (else only spilled ones go there);
        `max_chunk_bytes`: see open_tiers."""
        self.store = store
        self.max_raw = min(store.max_payload_bytes, max_chunk_bytes or store.max_payload_bytes)
        self.shared = SharedTier(store)
        self.lower: list[Tier] = [t for t in lower if t is not None]
        for t in self.lower:  # direct reads of a tier (fetch, read) are bounded as the chain's are
            if hasattr(t, "max_raw"):
                t.max_raw = self.max_raw
        self.threads = max(1, threads)
        self.write_through_on = write_through
        self._pool: ThreadPoolExecutor | None = None
        self.disk: Any = self.tier(DISK)
        self.remote: Any = self.tier(REMOTE)
        if self.remote is not None and hasattr(self.remote, "source"):
            self.remote.source = functools.partial(self._bytes_for, self.remote)

    @property
    def tiers(self) -> list[Tier]:
        return [self.shared, *self.lower]

    def tier(self, name: str) -> Any:
        """The lower tier of that name ("disk", "remote"), or None when the chain has none."""
        return next((t for t in self.lower if t.name == name), None)

    # ------------------------------------------------------------ walks --
    def held_prefix(self, full: Sequence[Unit], roots: Sequence[bytes], *, count: bool = False, lower: bool = True
                    ) -> list[tuple[Unit, str]]:
        """The longest prefix of `full` (units whose keys the caller made) that
        the tiers hold, as (unit, name of the tier holding it); the lower
        tiers are looked into only with `lower`; `count` counts the shared
        tier's lookup in its hit stats. No key is computed here."""
        n = self.shared.prefix_length(full, count)
        found = [(u, self.shared.name) for u in full[:n]]
        rest = full[n:]
        for tier in self.lower if lower else ():
            if not rest:
                break
            flags = self._held(tier, rest, roots)
            m = next((i for i, ok in enumerate(flags) if not ok), len(rest))
            found += [(u, tier.name) for u in rest[:m]]
            rest = rest[m:]
        return found

    def first_held(self, candidates: Sequence[Unit], roots: Sequence[bytes], lower: bool = True
                   ) -> tuple[Unit, str] | None:
        """The first of `candidates` (in the order given) that a tier holds,
        asking each tier in chain order, with that tier's name."""
        for tier in self.tiers if lower else [self.shared]:
            if not candidates:
                return None
            for u, ok in zip(candidates, self._held(tier, candidates, roots)):
                if ok:
                    return u, tier.name
        return None

    @staticmethod
    def _held(tier: Tier, units: Sequence[Unit], roots: Sequence[bytes]) -> list[bool]:
        """Whether `tier` holds every rank's key of each unit (one call)."""
        nr = len(roots)
        flags = tier.contains([k for u in units for k in u.keys], [r for _ in units for r in roots])
        return [all(flags[i * nr:(i + 1) * nr]) for i in range(len(units))]

    # -------------------------------------------------------- promotion --
    def promote(self, keys: Sequence[bytes], namespaces: Sequence[bytes], *, tokens: Sequence[int] | None = None,
                deadline_s: float | None = None) -> int:
        """Read chunks from the first lower tier holding them into the shared
        tier (`namespaces[i]` is keys[i]'s, `tokens[i]` the prompt tokens it
        holds), in prefix order, stopping at the first that is missing,
        damaged or does not fit, or when `deadline_s` seconds have passed.
        Returns how many of `keys` are in the shared tier afterwards (a prefix)."""
        store = self.store
        t_end = None if deadline_s is None else time.monotonic() + deadline_s
        n = 0
        # NOTE: up to `threads` chunks ahead are fetched and decoded straight
        # into their reservations in parallel (zstd and the unshuffle without
        # the GIL, no copy after); the reservations are committed here, in
        # prefix order, so a chunk never becomes visible before the ones in
        # front of it. After a miss the reservations ahead are aborted.
        ahead: deque[tuple[bytes, Any]] = deque()  # (key, its fetch; None: already in the shared tier)
        todo = iter(zip(keys, namespaces, tokens if tokens is not None else [0] * len(keys)))
        try:
            while True:
                while len(ahead) < self.threads and (t_end is None or time.monotonic() <= t_end):
                    item = next(todo, None)
                    if item is None:
                        break
                    ahead.append((item[0], None if store.contains([item[0]])[0] else self._submit(item)))
                if not ahead:
                    break
                key, fetch = ahead.popleft()
                if fetch is None:
                    n += 1
                    continue
                got, source = fetch.result() if isinstance(fetch, Future) else fetch
                if got is None:
                    break
                if isinstance(got, PutResult):  # no reservation: cached meanwhile, or no room
                    if got is not PutResult.EXISTS:
                        store.bump("promote_errors")
                        break
                    n += 1
                    continue
                res, raw_len = got
                if res.commit() is not PutResult.OK:
                    store.bump("promote_errors")
                    break
                if source == DISK:
                    store.mark_spilled(key)  # a copy is on disk: evicting it loses nothing
                store.bump(f"{source}_hits")
                store.bump("promote_bytes", raw_len)
                n += 1
        finally:
            for _key, fetch in ahead:  # the prefix ended before them: give their room back
                if fetch is None or (isinstance(fetch, Future) and fetch.cancel()):
                    continue
                got, _source = fetch.result() if isinstance(fetch, Future) else fetch
                if isinstance(got, tuple):
                    got[0].abort()
        return n

    def _fetch(self, item: tuple[bytes, bytes, int]) -> tuple[Any, str | None]:
        """From the first lower tier holding the chunk: ((its filled
        reservation, raw bytes) | a PutResult when the shared tier gave no
        room or holds it already | None, tier name)."""
        key, ns, ntok = item
        held: list[Any] = []

        def alloc(raw_len: int, chunk_ns: bytes) -> Any:
            r = self.store.reserve(key, raw_len, namespace=chunk_ns, tokens=ntok)
            held.append(r)
            return None if isinstance(r, PutResult) else r.view()

        for tier in self.lower:
            try:
                got = tier.fetch_into(key, ns, alloc, max_raw=self.max_raw)
            except Exception as e:  # a tier's own faults are misses; anything else must not reach vLLM either
                for r in held:
                    if not isinstance(r, PutResult):
                        r.abort()
                self.store.bump("promote_errors")
                log.warning("shmkv: promoting chunk %s from the %s tier failed: %s: %s", key.hex(), tier.name,
                            type(e).__name__, e)
                return None, None
            res = held.pop() if held else None
            if got is not None:
                return (res, memoryview(got[0]).nbytes), tier.name
            if isinstance(res, PutResult):
                return res, tier.name
            if res is not None:
                res.abort()  # damaged after the room was taken
        return None, None

    def _submit(self, item: tuple[bytes, bytes, int]) -> Any:
        """A fetch: done now (one thread), or running on the pool (a Future)."""
        if self.threads == 1:
            return self._fetch(item)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shmkv-promote-io")
        return self._pool.submit(self._fetch, item)

    # ------------------------------------------------------------- moves --
    def spill(self, key: bytes, ns: bytes) -> Spill:
        """Write one shared-tier chunk to the disk tier (as it is when it is
        compressed), mark it spilled, and queue it for the remote tier."""
        disk, store = self.disk, self.store
        if disk is None:
            return Spill.NO_DISK
        if disk.contains([key])[0]:
            store.mark_spilled(key)
            return Spill.ALREADY
        leases = store.acquire_prefix([key], count_lookup=False)
        if not leases:
            return Spill.GONE  # evicted or deleted meanwhile
        lease = leases[0]
        tokens = lease.tokens
        try:
            if lease.compressed:  # already in the chunk format: written as it is
                ok = disk.write_encoded(key, lease.view(), tokens)
            else:
                ok = disk.write(key, ns, lease.view(), tokens)
        finally:
            valid = lease.release(cold=True)
        if not ok:
            return Spill.FAILED
        if not valid:
            disk.remove(key)  # the bytes may have been reused under us
            return Spill.RACED
        store.mark_spilled(key)
        if self.remote is not None:
            self.remote.enqueue(key, ns, tokens)
        return Spill.SPILLED

    def write_through(self, key: bytes, ns: bytes, tokens: int = 0) -> None:
        """A chunk just committed to the shared tier: queued for the remote
        tier when the chain writes through."""
        if self.write_through_on and self.remote is not None:
            self.remote.enqueue(key, ns, tokens)

    def flush(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Make what the lower tiers were given durable: the disk tier's files
        synced, the remote tier's queue drained (at most timeout_s)."""
        out: dict[str, Any] = {}
        if self.disk is not None:
            out["synced_files"] = self.disk.sync()
        if self.remote is not None:
            out["remote_flushed"] = self.remote.flush(timeout_s=timeout_s)
        return out

    def _bytes_for(self, tier: Any, key: bytes, ns: bytes, codec: str
                   ) -> tuple[bytes, tuple[str, int, float] | None] | None:
        """A chunk's bytes in the chunk format for `tier` (the remote's
        source): its disk file when that is compressed or raw is what the tier
        picked (`codec`), else encoded with the tier's settings from the
        file's raw body or from the shared tier; with the figures of encoding
        it now (None: reused as they were). None if no tier holds it any more."""
        raw: bytes | memoryview | None = None
        if self.disk is not None:
            data = self.disk.read_file(key)  # a sound header; decode() checks the rest on read
            if data is not None:
                if fmt.codec_of(data) != RAW or codec == RAW:  # compressed (or lossy): as it is
                    return data, None
                raw = fmt.decode_or_none(data, key)  # None: damaged; the disk tier drops it on its next read
        if raw is not None:
            t0 = time.perf_counter()
            data = fmt.encode(key, ns, raw, element_size=tier.element_size, level=tier.level, codec=codec)
            return data, (codec, len(raw), time.perf_counter() - t0)
        leases = self.store.acquire_prefix([key], count_lookup=False)
        if not leases:
            return None
        lease = leases[0]
        try:
            t0 = time.perf_counter()
            view = lease.view()
            if lease.compressed:  # already in the chunk format
                data, measured = bytes(view), None
            else:
                data = fmt.encode(key, ns, view, element_size=tier.element_size, level=tier.level, codec=codec)
                measured = (codec, memoryview(view).nbytes, time.perf_counter() - t0)
        finally:
            valid = lease.release()
        return (data, measured) if valid else None

    def close(self, flush_timeout_s: float = 10.0) -> None:
        """Stop the chain's threads; the remote tier's queued writes get
        flush_timeout_s to finish before it disconnects."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.remote is not None:
            self.remote.flush(timeout_s=flush_timeout_s)
            self.remote.close()

    # ----------------------------------------------------------- admin --
    def clear(self, namespace: bytes | None = None) -> dict[str, int]:
        """Drop every chunk (of one namespace) from every tier; how many per tier."""
        return {t.name: t.clear(namespace) for t in self.tiers}

