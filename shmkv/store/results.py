"""The store's vocabulary: the core's result codes (Status), the ordinary
outcomes (PutResult, ReadResult, Presence, OpenOutcome), entry flags, key
types, and the mapping of error codes to shmkv.errors' exceptions."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from shmkv import _C
from shmkv.errors import BY_STATUS, error_for

Key = bytes
Keys = Sequence[bytes] | bytes | bytearray | memoryview

FLAG_SPILLED = int(_C.FLAG_SPILLED)  # Entry flag: a copy is in the disk tier
FLAG_COMPRESSED = int(_C.FLAG_COMPRESSED)  # Entry flag: the payload is an encoded chunk (shmkv.tiers.format)

# The core's result codes (cpp/status.h, exported as _C.Status), as ints.
Status = enum.IntEnum("Status", {name: int(v) for name, v in _C.Status.__members__.items()})
_missing = {Status(c).name for c in _C.ERROR_CODES} - set(BY_STATUS)
if _missing:  # a code added in C++ without its exception class (shmkv/errors.py)
    raise ImportError(f"shmkv.errors.BY_STATUS lacks the C++ error codes {sorted(_missing)}")


class Role(enum.Enum):
    """Exclusive roles among every process sharing a segment, in any PID
    namespace (Store.try_hold_role: a byte of the segment file's OFD locks)."""

    MAINTAINER = 0  # runs maintenance passes (shmkv.services.maintainer)
    DAEMON = 1  # the cache's daemon runs: embedded maintainers stand by


class PutResult(enum.Enum):
    """Outcome of a store operation that is not an error."""

    OK = Status.OK.value
    FULL = Status.FULL.value  # no room even after evicting everything evictable
    EXISTS = Status.EXISTS.value  # the key is already cached
    BUSY = Status.BUSY.value  # another live process is writing the key right now (or holds the lock too long)
    STALE = Status.STALE.value  # the reservation was reclaimed before commit; nothing stored
    TIMED_OUT = Status.TIMED_OUT.value  # the table lock stayed held past the bound; nothing changed


class ReadResult(enum.Enum):
    """Outcome of copying one chunk out of the segment (Store.read_chunks)."""

    OK = Status.OK.value
    MISS = Status.MISS.value  # not cached (or not committed yet)
    STALE = Status.STALE.value  # reclaimed during the copy: the bytes copied are not to be trusted
    MISMATCH = Status.MISMATCH.value  # another size, or a compressed payload: nothing copied
    TIMED_OUT = Status.TIMED_OUT.value  # the table lock stayed held past the bound


class Presence(enum.Enum):
    """Where a key stands in the table (Store.presence)."""

    ABSENT = 0
    READY = 1  # committed: readers get it
    WRITING = 2  # reserved by a writer that has not committed yet


READ_RESULT_OF = {r.value: r for r in ReadResult}
PRESENCE_OF = {p.value: p for p in Presence}


class OpenOutcome(enum.Enum):
    CREATED = 0
    ATTACHED = 1
    REINITIALISED_STALE = 2  # a segment nobody was attached to was emptied
    ADOPTED_STALE = 3  # ... or kept, after a rebuild, because it matched


def raise_status(code: int, message: str) -> None:
    name = Status(code).name if code in Status._value2member_map_ else str(code)
    raise error_for(name, message or name)


def raise_if_error(code: int, message: str = "") -> None:
    """Raise for the error codes of cpp/status.h; ordinary outcomes pass."""
    if code in _C.ERROR_CODES:
        raise_status(code, message)
