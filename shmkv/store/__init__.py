"""The shared-memory chunk store: one named POSIX segment per host that every
vLLM process attaches (the C++ table in shmkv._C underneath).

    store.py     Store: the segment's lifecycle, the background reservation
                 of its arena, and every table operation
    handles.py   Reservation / Lease: windows on one chunk's payload
    results.py   result codes, ordinary outcomes, flags, key types
    opening.py   the restart policy: which segment a configuration opens

May import shmkv._C, shmkv.errors and (opening.py) shmkv.config; nothing
else of shmkv: the tiers, the transfer path and the services build on it.
"""

from __future__ import annotations

from shmkv.store.handles import Lease, Reservation
from shmkv.store.opening import open_store
from shmkv.store.results import (
    FLAG_COMPRESSED,
    FLAG_SPILLED,
    Key,
    Keys,
    OpenOutcome,
    Presence,
    PutResult,
    ReadResult,
    Role,
    Status,
)
from shmkv.store.store import (
    DEFAULT_LOCK_TIMEOUT_S,
    INIT_WAIT_S,
    RESERVE_STEP,
    SegmentGeometry,
    Store,
    default_cache_name,
)

__all__ = ["DEFAULT_LOCK_TIMEOUT_S", "FLAG_COMPRESSED", "FLAG_SPILLED", "INIT_WAIT_S", "RESERVE_STEP", "Key", "Keys",
           "Lease", "OpenOutcome", "Presence", "PutResult", "ReadResult", "Reservation", "Role", "SegmentGeometry",
           "Status",
           "Store", "default_cache_name", "open_store"]
