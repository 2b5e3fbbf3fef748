"""Re-encoding chunks in place in the shared tier: the one place that turns a
raw chunk into the chunk format (POST /compress), back (POST /decompress),
or into its lossy form (POST /compress with "form"); the controller calls it.

A compressed entry is the chunk format (shmkv.tiers.format: zstd of the
byte-shuffled payload with every check) under the same key, flagged
compressed; loads decode it, spills write it as it is. A lossy form lives
under its own key and namespace (shmkv.keys.lossy_key). Invariants: a pinned
chunk is the operator's and is left as it is; an admin read never counts as
a use (leases released cold); bytes read under a lease reclaimed meanwhile
are never written back.
"""

from __future__ import annotations

from typing import Any

from shmkv.store import FLAG_SPILLED, PutResult, Store
from shmkv.tiers import format as fmt


def compress(store: Store, entry: dict[str, Any], *, element_size: int, level: int = 1) -> str:
    """Re-encode one raw chunk (`entry`: its Store.entries() record)
    compressed: "compressed", or why not ("missing", "already", "pinned",
    "incompressible", "raced")."""
    return _recode(store, entry, compress=True, element_size=element_size, level=level)


def decompress(store: Store, entry: dict[str, Any]) -> str:
    """Put one compressed chunk back raw: "decompressed", or why not
    ("missing", "already", "pinned", "damaged", "raced")."""
    return _recode(store, entry, compress=False)


def make_lossy(store: Store, entry: dict[str, Any], form: str, dtype: str, *, keep_exact: bool = False
               ) -> tuple[str, float]:
    """Put the lossy `form` of one exact chunk in the lossy namespace
    (shmkv.keys.lossy_key of its key and namespace), flagged compressed, and
    drop the exact chunk unless `keep_exact`. (outcome, relative RMS error of
    the form): "made", or why not ("missing", "pinned", "exists",
    "not_finite", "raced", "full")."""
    from shmkv.keys import lossy_key

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
        raw = fmt.decode_or_none(lease.view(), key) if lease.compressed else lease.view()
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


def _recode(store: Store, entry: dict[str, Any], *, compress: bool, element_size: int = 2, level: int = 1) -> str:
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
            data = fmt.decode_or_none(lease.view(), key, lossy_ok=True)  # a lossy chunk stays under its lossy key
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
