"""Reservation and Lease: a writable / read-only window on one chunk's payload
in the segment, with zero-copy numpy and torch views. A handle dropped while
open is aborted / released (only in the process that made it).

Views never outlive what they view:
  * a Lease's views are read-only (memoryview, numpy); Lease.torch() is a
    copy, since torch has no read-only tensors and a writable tensor over a
    committed chunk would change it for every process;
  * Reservation.commit() refuses (StaleHandleError naming the key) while a
    numpy or torch object made from one of its views is alive: the chunk must
    not change once readers can see it;
  * Reservation.abort() with such an object alive keeps the room reserved
    until the object is gone (retried by the process's next reserve), so a
    stale view never writes into a chunk that reuses the extent."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shmkv.errors import StaleHandleError
from shmkv.store.results import FLAG_COMPRESSED, PutResult, Status, raise_if_error

if TYPE_CHECKING:
    import numpy as np
    import torch


def _torch_view(buf: memoryview, dtype: torch.dtype, shape: Sequence[int] | None,
                exports: list[weakref.ref] | None = None) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():
        # read-only leases: torch warns that it cannot guarantee immutability
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=torch.uint8)
    t = t.view(dtype)
    t = t.reshape(tuple(shape)) if shape is not None else t
    if exports is not None:
        # NOTE: the tensor handed out; a view made from it and kept after it is
        # dropped is not tracked (torch frees the Python object of a _base)
        exports.append(weakref.ref(t))
    return t


class _PayloadHandle:
    """Shared view helpers of Reservation and Lease."""

    _c: Any
    _views: list[memoryview]
    _exports: list[weakref.ref]  # numpy arrays / torch tensors made over the payload

    @property
    def size(self) -> int:
        """Payload bytes."""
        return int(self._c.size)

    @property
    def address(self) -> int:
        """Address of the payload in this process (for copy kernels)."""
        return int(self._c.address)

    def view(self) -> memoryview:
        """Zero-copy memoryview of the payload (read-only for leases)."""
        mv = memoryview(self._c)
        self._views.append(mv)
        return mv

    def numpy(self, dtype: Any = "uint8", shape: Sequence[int] | None = None) -> np.ndarray:
        """Zero-copy numpy array over the payload."""
        import numpy as np

        a = np.frombuffer(self.view(), dtype=dtype)
        self._exports.append(weakref.ref(a))  # arrays made from it keep it alive (their base)
        return a.reshape(tuple(shape)) if shape is not None else a

    def torch(self, dtype: torch.dtype | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Zero-copy CPU torch tensor over the payload (a Lease's: a copy, see the module doc)."""
        import torch

        return _torch_view(self.view(), dtype or torch.uint8, shape, self._exports)

    def _drop_views(self) -> bool:
        """Release this handle's views; False (nothing released) when a numpy
        or torch object made from one is still alive."""
        self._exports = [w for w in self._exports if w() is not None]
        if self._exports:
            return False
        for mv in self._views:
            try:
                mv.release()
            except BufferError:  # exported by a consumer we do not track: it keeps the mapping alive
                pass
        self._views.clear()
        return True


# Reservations aborted while a view of them was alive: their room stays
# reserved until the views die (retry_deferred_aborts, from Store.reserve).
DEFERRED_ABORTS: list[Reservation] = []


class Reservation(_PayloadHandle):
    """Room for one chunk, invisible to readers until commit().

    As a context manager it commits when the block ends normally and aborts
    when it raises. A reservation dropped without either is aborted.
    """

    __slots__ = ("_c", "_views", "_exports", "key")

    def __init__(self, c: Any, key: bytes) -> None:
        self._c = c
        self._views = []
        self._exports = []
        self.key = key

    def commit(self) -> PutResult:
        """Make the chunk visible. STALE: it was reclaimed meanwhile (this
        process was presumed dead); nothing was stored. Raises
        StaleHandleError, leaving the reservation open, while an object made
        from one of its views is alive (delete it, then commit)."""
        if not self._drop_views():
            raise StaleHandleError(f"reservation of chunk {self.key.hex()}: {len(self._views)} view(s) still "
                                   "exported to numpy/torch objects; delete them before commit (a committed "
                                   "chunk must not change)")
        code = self._c.commit()
        raise_if_error(code)
        return PutResult(code)

    def abort(self) -> None:
        """Give the room back; while an object made from one of its views is
        alive, once it is gone (module doc)."""
        if not self._drop_views():
            if self not in DEFERRED_ABORTS:
                DEFERRED_ABORTS.append(self)
            return
        raise_if_error(self._c.abort())

    @property
    def is_open(self) -> bool:
        return bool(self._c.is_open)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self._c.is_open:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def retry_deferred_aborts() -> None:
    """Abort the deferred reservations whose views have died since."""
    for r in list(DEFERRED_ABORTS):
        if r._drop_views():
            DEFERRED_ABORTS.remove(r)
            if r._c.is_open:
                raise_if_error(r._c.abort())


class Lease(_PayloadHandle):
    """A read lease on one READY chunk: its bytes cannot change or be evicted
    until release(). Released on context exit; a lease dropped without release
    is released by its destructor."""

    __slots__ = ("_c", "_views", "_exports")

    def __init__(self, c: Any) -> None:
        self._c = c
        self._views = []
        self._exports = []

    def release(self, *, cold: bool = False) -> bool:
        """Give the lease back. False means it had been reclaimed: bytes read
        through it may be wrong and must be discarded. `cold` leaves the chunk
        where it was in the LRU order (a maintenance read is not a use). A
        numpy array taken from it must not be read after this."""
        self._exports.clear()
        self._drop_views()
        code = self._c.release(cold)
        raise_if_error(code)
        return code == Status.OK

    def torch(self, dtype: torch.dtype | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """A CPU torch tensor holding a copy of the payload: torch has no
        read-only tensors (numpy() and view() are zero-copy and read-only)."""
        import torch

        mv = memoryview(self._c)
        try:
            return _torch_view(memoryview(bytearray(mv)), dtype or torch.uint8, shape)
        finally:
            mv.release()

    @property
    def tokens(self) -> int:
        """The prompt tokens the chunk holds, as its writer gave them (0: not given)."""
        return int(self._c.tokens)

    @property
    def compressed(self) -> bool:
        """Whether the payload is an encoded chunk (shmkv.tiers.format) rather than raw KV."""
        return bool(self._c.flags & FLAG_COMPRESSED)

    @property
    def is_open(self) -> bool:
        return bool(self._c.is_open)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._c.is_open and not self.release() and exc_type is None:
            raise StaleHandleError("lease was reclaimed while in use; discard what was read")
