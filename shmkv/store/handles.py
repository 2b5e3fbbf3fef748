"""Reservation and Lease: a writable / read-only window on one chunk's payload
in the segment, with zero-copy numpy and torch views. A handle dropped while
open is aborted / released (only in the process that made it)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shmkv.errors import StaleHandleError
from shmkv.store.results import FLAG_COMPRESSED, PutResult, Status, _raise_if_error

if TYPE_CHECKING:
    import numpy as np
    import torch


def _torch_view(buf: memoryview, dtype: torch.dtype, shape: Sequence[int] | None) -> torch.Tensor:
    import torch

    with warnings.catch_warnings():
        # read-only leases: torch warns that it cannot guarantee immutability
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(buf, dtype=torch.uint8)
    t = t.view(dtype)
    return t.reshape(tuple(shape)) if shape is not None else t


class _PayloadHandle:
    """Shared view helpers of Reservation and Lease."""

    _c: Any
    _views: list[memoryview]

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
        return a.reshape(tuple(shape)) if shape is not None else a

    def torch(self, dtype: torch.dtype | None = None, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Zero-copy CPU torch tensor over the payload."""
        import torch

        return _torch_view(self.view(), dtype or torch.uint8, shape)

    def _drop_views(self) -> None:
        for mv in self._views:
            try:
                mv.release()
            except BufferError:
                # a numpy/torch object made from it is still alive; the mapping
                # stays valid, but its bytes may be reused from now on
                pass
        self._views.clear()


class Reservation(_PayloadHandle):
    """Room for one chunk, invisible to readers until commit().

    As a context manager it commits when the block ends normally and aborts
    when it raises. A reservation dropped without either is aborted.
    """

    __slots__ = ("_c", "_views", "key")

    def __init__(self, c: Any, key: bytes) -> None:
        self._c = c
        self._views = []
        self.key = key

    def commit(self) -> PutResult:
        """Make the chunk visible. STALE: it was reclaimed meanwhile (this
        process was presumed dead); nothing was stored."""
        self._drop_views()
        code = self._c.commit()
        _raise_if_error(code)
        return PutResult(code)

    def abort(self) -> None:
        """Give the room back."""
        self._drop_views()
        _raise_if_error(self._c.abort())

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


class Lease(_PayloadHandle):
    """A read lease on one READY chunk: its bytes cannot change or be evicted
    until release(). Released on context exit; a lease dropped without release
    is released by its destructor."""

    __slots__ = ("_c", "_views")

    def __init__(self, c: Any) -> None:
        self._c = c
        self._views = []

    def release(self, *, cold: bool = False) -> bool:
        """Give the lease back. False means it had been reclaimed: bytes read
        through it may be wrong and must be discarded. `cold` leaves the chunk
        where it was in the LRU order (a maintenance read is not a use)."""
        self._drop_views()
        code = self._c.release(cold)
        _raise_if_error(code)
        return code == Status.OK

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
