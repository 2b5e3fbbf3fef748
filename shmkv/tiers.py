"""The tier chain: shared memory -> disk -> remote, walked as one.

Every tier implements `Tier` with one signature; the chain owns the two
walks that cross tiers, so the vLLM connector, the controller and the
benchmarks never call a tier in a shape of its own:

  * the prefix walk (`cached_prefix`): the longest prefix of a prompt's
    units that some tier holds, in prefix order: units 0..a from the shared
    tier, a..b from disk, b..c from remote; the first unit no tier holds ends
    it (later units are useless without it). A unit is held by a tier when
    that tier holds the key of every TP rank. After the full chunks, the
    longest tail piece (shmkv.chunking) any tier holds may extend it.
  * promotion (`promote`): units found below the shared tier are read from
    the first lower tier that has them and put into the shared tier, in
    prefix order, stopping at the first that cannot be (missing, damaged,
    no room) or at a deadline.

Invariants: the shared tier is always first (loads come only from it); a
lower tier's miss, error or damage is a miss and a counter, never an
exception to the caller; nothing here holds the table lock across tiers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from shmkv.chunking import Chunker, Unit
from shmkv.keys import ExtraInputs
from shmkv.store import FLAG_SPILLED, PutResult, Store


class Tier(Protocol):
    """One level of the cache. `name` labels its counters ("<name>_hits")."""

    name: str

    def contains(self, keys: Sequence[bytes], namespaces: Sequence[bytes]) -> list[bool]:
        """For each (key, namespace): whether this tier holds it."""

    def fetch(self, key: bytes, namespace: bytes) -> tuple[bytes, bytes] | None:
        """(payload, namespace) of a checked chunk, or None (missing, damaged, unreachable)."""

    def fetch_into(self, key: bytes, namespace: bytes, alloc: Callable[[int, bytes], Any]) -> tuple[Any, bytes] | None:
        """Like fetch, but decoded straight into alloc(raw_len, namespace)'s
        buffer: (that buffer, namespace), or None (missing, damaged, or alloc
        gave no buffer; what alloc gave is then the caller's to discard)."""

    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview, tokens: int = 0) -> bool:
        """Store one chunk's payload (`tokens`: the prompt tokens it holds, for
        the put_tokens counters); False if it could not be (counted)."""

    def remove(self, key: bytes, namespace: bytes) -> bool:
        """Drop one chunk; False if it was not there."""

    def clear(self, namespace: bytes | None = None) -> int:
        """Drop every chunk (of one namespace); returns how many."""


class SharedTier:
    """The shared-memory segment as a Tier (plus the prefix lookup only it has)."""

    name = "shm"

    def __init__(self, store: Store) -> None:
        self.store = store

    def contains(self, keys: Sequence[bytes], namespaces: Sequence[bytes] | None = None) -> list[bool]:
        return self.store.contains(keys)

    def fetch(self, key: bytes, namespace: bytes) -> tuple[bytes, bytes] | None:
        lease = self.store.acquire(key)
        if lease is None:
            return None
        with lease:
            raw = decoded(lease, key, lossy_ok=True) if lease.compressed else bytes(lease.view())
        return None if raw is None else (raw, namespace)

    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview, tokens: int = 0) -> bool:
        return self.store.put(key, raw, namespace=namespace, tokens=tokens) in (PutResult.OK, PutResult.EXISTS)

    def remove(self, key: bytes, namespace: bytes | None = None) -> bool:
        return self.store.delete(key)

    def clear(self, namespace: bytes | None = None) -> int:
        return self.store.clear(namespace=namespace)

    # ------------------------------------------------- compressed entries --
    # POST /compress re-encodes a chunk into the chunk format (zstd of the
    # byte-shuffled payload, every check of shmkv.disk.format) under the same
    # key, flagged compressed; loads decode it (decoded()), spills write it as
    # it is. /decompress puts the raw payload back.
    def compress(self, entry: dict[str, Any], *, element_size: int, level: int = 1) -> str:
        """Re-encode one raw chunk (`entry`: its Store.entries() record)
        compressed: "compressed", or why not ("missing", "already", "pinned",
        "incompressible", "raced")."""
        return self._recode(entry, compress=True, element_size=element_size, level=level)

    def decompress(self, entry: dict[str, Any]) -> str:
        """Put one compressed chunk back raw: "decompressed", or why not
        ("missing", "already", "pinned", "damaged", "raced")."""
        return self._recode(entry, compress=False)

    def make_lossy(self, entry: dict[str, Any], form: str, dtype: str, *, keep_exact: bool = False
                   ) -> tuple[str, float]:
        """Put the lossy `form` of one exact chunk in the lossy namespace
        (shmkv.keys.lossy_key of its key and namespace), flagged compressed,
        and drop the exact chunk unless `keep_exact`. (outcome, relative RMS
        error of the form): "made", or why not ("missing", "pinned", "exists",
        "not_finite", "raced", "full")."""
        from shmkv.disk import format as fmt
        from shmkv.keys import lossy_key

        store = self.store
        key, namespace = entry["key"], entry["namespace"]
        if entry["pins"]:
            return "pinned", 0.0
        to = lossy_key(key, form)
        if store.contains([to])[0]:
            return "exists", 0.0
        leases = store.acquire_prefix([key], count_lookup=False)
        if not leases:
            return "missing", 0.0
        lease = leases[0]
        data: bytes | None = None
        err = 0.0
        try:
            tokens = lease.tokens
            raw = decoded(lease, key) if lease.compressed else lease.view()
            if raw is not None:
                try:
                    data, err = fmt.encode_fp8(to, lossy_key(namespace, form), raw, dtype)
                except ValueError:
                    return "not_finite", 0.0
        finally:
            if not lease.release(cold=True):
                data = None
        if data is None:
            return "raced", 0.0
        got = store.put(to, data, namespace=lossy_key(namespace, form), tokens=tokens, compressed=True)
        if got is PutResult.EXISTS:
            return "exists", 0.0
        if got is not PutResult.OK:
            return ("full" if got is PutResult.FULL else "raced"), 0.0
        if not keep_exact:
            store.delete(key)
        return "made", err

    def _recode(self, entry: dict[str, Any], *, compress: bool, element_size: int = 2, level: int = 1) -> str:
        from shmkv.disk import format as fmt

        store = self.store
        key, namespace = entry["key"], entry["namespace"]
        if entry["pins"]:
            return "pinned"  # a pin is the operator's: its chunk is left as it is
        leases = store.acquire_prefix([key], count_lookup=False)
        if not leases:
            return "missing"
        lease = leases[0]
        try:
            if lease.compressed == compress:
                return "already"
            tokens = lease.tokens
            if compress:
                view = lease.view()
                data = fmt.encode(key, namespace, view, element_size=element_size, level=level)
                if len(data) >= memoryview(view).nbytes:
                    return "incompressible"
            else:
                data = decoded(lease, key, lossy_ok=True)  # a lossy chunk stays under its lossy key
                if data is None:
                    return "damaged"
        finally:
            if not lease.release(cold=True):  # an admin read is not a use
                data = None
        if data is None:
            return "raced"  # the lease was reclaimed: what was read may be wrong
        spilled = bool(entry["flags"] & FLAG_SPILLED)
        # NOTE: between the delete and the put a lookup misses (vLLM computes);
        # a lease taken before the delete keeps the old bytes until released.
        store.delete(key)
        if store.put(key, data, namespace=namespace, tokens=tokens, compressed=compress) is not PutResult.OK:
            return "raced"  # written meanwhile by someone else (or no room): theirs stays
        if spilled:
            store.mark_spilled(key)
        return "compressed" if compress else "decompressed"

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

    def __init__(self, store: Store, lower: Sequence[Tier | None] = (), *, threads: int = 1) -> None:
        """`threads`: chunks fetched (read and decoded, without the GIL) at once when promoting."""
        self.store = store
        self.shared = SharedTier(store)
        self.lower: list[Tier] = [t for t in lower if t is not None]
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = None

    @property
    def tiers(self) -> list[Tier]:
        return [self.shared, *self.lower]

    def tier(self, name: str) -> Any:
        """The lower tier of that name ("disk", "remote"), or None when the chain has none."""
        return next((t for t in self.lower if t.name == name), None)

    # ------------------------------------------------------------ walks --
    def cached_prefix(self, chunker: Chunker, tokens: Sequence[int] | np.ndarray, units: Sequence[Unit], *,
                      count: bool = False, lower: bool = True, extras: ExtraInputs | None = None
                      ) -> list[tuple[Unit, str]]:
        """The longest cached prefix of a prompt's `units` (chunker.units of
        `tokens`) as (unit, name of the tier holding it); the lower tiers are
        looked into only with `lower`."""
        full = [u for u in units if u.tokens == chunker.chunk_size]
        found = self._full_chunks(full, chunker.roots, count, lower)
        if chunker.piece_size and chunker.piece_size < chunker.chunk_size:
            prev = found[-1][0].chain if found else chunker.chain_roots
            cands = chunker.piece_candidates(tokens, len(found) * chunker.chunk_size, prev, extras)
            held = self.first_held(cands, chunker.roots, lower)
            if held is not None:
                found.append(held)
        return found

    def _full_chunks(self, full: list[Unit], roots: Sequence[bytes], count: bool, lower: bool
                     ) -> list[tuple[Unit, str]]:
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
                if source == "disk":
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
                got = tier.fetch_into(key, ns, alloc)
            except BaseException:
                for r in held:
                    if not isinstance(r, PutResult):
                        r.abort()
                raise
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

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ----------------------------------------------------------- admin --
    def clear(self, namespace: bytes | None = None) -> dict[str, int]:
        """Drop every chunk (of one namespace) from every tier; how many per tier."""
        return {t.name: t.clear(namespace) for t in self.tiers}


def decoded(lease: Any, key: bytes, *, lossy_ok: bool = False) -> bytes | None:
    """The raw payload of a compressed chunk under `lease` (every check of
    shmkv.disk.format), or None if it is damaged (or lossy, unless `lossy_ok`)."""
    from shmkv.disk import format as fmt

    try:
        return fmt.decode(lease.view(), key, lossy_ok=lossy_ok)[0]
    except fmt.DamagedChunk:
        return None
