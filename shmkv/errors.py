"""The shmkv exception hierarchy.

"Miss", "full", "exists" and "busy" are ordinary results and never raise. The
exceptions below map the error codes of the C++ core (cpp/status.h, exported
as shmkv._C.Status) one to one, by name, plus configuration errors found in
Python. shmkv.store checks at import that every error code has its class.

    ShmkvError
    ├── ConfigError            a bad configuration value (names key, value, what is accepted)
    ├── SegmentError           anything about opening a segment
    │   ├── SegmentNotFoundError
    │   ├── SegmentExistsError
    │   ├── SegmentMismatchError   built or configured differently; nothing was written
    │   ├── SegmentCorruptError
    │   ├── NoSpaceError           /dev/shm cannot hold the requested capacity
    │   └── PermissionDeniedError  (also a PermissionError)
    ├── PayloadTooLargeError   (also a ValueError)
    ├── InvalidArgumentError   (also a ValueError)
    ├── RequestError           a controller request refused (carries its HTTP status)
    ├── LockTimeoutError       a whole-table operation could not get the table lock in time
    ├── StaleHandleError       a lease/reservation was reclaimed: its bytes are void
    └── StoreInUseError        close() while this attachment's leases/reservations are open
"""

from __future__ import annotations


class ShmkvError(Exception):
    """Base class of every error shmkv raises on purpose."""


class ConfigError(ShmkvError, ValueError):
    """A configuration value is invalid."""


class SegmentError(ShmkvError):
    """Opening or validating a shared-memory segment failed."""


class SegmentNotFoundError(SegmentError, FileNotFoundError):
    pass


class SegmentExistsError(SegmentError, FileExistsError):
    pass


class SegmentMismatchError(SegmentError):
    pass


class SegmentCorruptError(SegmentError):
    pass


class NoSpaceError(SegmentError, OSError):
    pass


class PermissionDeniedError(SegmentError, PermissionError):
    pass


class PayloadTooLargeError(ShmkvError, ValueError):
    pass


class InvalidArgumentError(ShmkvError, ValueError):
    pass


class RequestError(ShmkvError, ValueError):
    """A controller request that is malformed, out of range or not possible
    here; `status` is the HTTP status to answer with (4xx)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class StaleHandleError(ShmkvError):
    """The lease or reservation was reclaimed (its owner was presumed dead, or
    the segment was reset). Bytes read through it must be discarded."""


class StoreInUseError(ShmkvError):
    """Store.close() while leases or reservations of this attachment are
    still open: closing would give up the liveness that keeps other processes
    from reclaiming them, and a late copy through them would land in another
    chunk. The store stays attached; release, commit or abort them first."""


class SystemCallError(ShmkvError, OSError):
    pass


class LockTimeoutError(ShmkvError, TimeoutError):
    """The segment's table lock stayed held by another process past the bound
    (`lock_timeout`); the message names the holder. Lookups and puts never
    raise this: they answer "miss" and "busy"."""


# status name (shmkv._C.Status) -> exception class: the error codes, and the
# two ordinary outcomes that raise where a caller cannot go on (a reclaimed
# handle, a whole-table operation that could not get the lock)
BY_STATUS: dict[str, type[ShmkvError]] = {
    "STALE": StaleHandleError,
    "TIMED_OUT": LockTimeoutError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "TOO_LARGE": PayloadTooLargeError,
    "NO_SPACE": NoSpaceError,
    "NOT_FOUND": SegmentNotFoundError,
    "ALREADY_EXISTS": SegmentExistsError,
    "MISMATCH": SegmentMismatchError,
    "PERMISSION": PermissionDeniedError,
    "CORRUPT": SegmentCorruptError,
    "SYSTEM": SystemCallError,
}


def error_for(status: str, message: str) -> ShmkvError:
    """The exception for a C++ status, by name (which must be an error's)."""
    return BY_STATUS.get(status, ShmkvError)(message)
