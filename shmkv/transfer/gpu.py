"""GPU side of the segment: every process whose KV cache is on a CUDA device
registers its mapping of the segment's payload arena with cudaHostRegister
(pinned, mapped), so the CUDA copy backend (shmkv.transfer.copy_backends.CudaCopy)
addresses payloads directly.

Imported only for a KV cache on a CUDA device; a CPU-only process never
loads shmkv._C_cuda.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from shmkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shmkv.store import Store


def unavailable() -> str | None:
    """Why the CUDA path cannot run in this process (no GPU, or shmkv built
    without _C_cuda), or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    try:
        import shmkv._C_cuda  # noqa: F401
    except ImportError as e:
        return f"shmkv was built without its CUDA part: {e}"
    return None


def extension() -> Any:
    """shmkv._C_cuda, or a clear error naming the fix."""
    try:
        from shmkv import _C_cuda
    except ImportError as e:  # built without nvcc, or no CUDA runtime here
        raise InvalidArgumentError(
            "shmkv was built without its CUDA kernels (no nvcc at build time?); "
            f"cannot copy a CUDA KV cache: {e}"
        ) from e
    return _C_cuda


# This process's registrations: (address, bytes) -> how many users. A range is
# registered once, by its first user, and unregistered by its last.
_registered: dict[tuple[int, int], int] = {}
_lock = threading.Lock()


def register_segment(store: Store) -> float:
    """Pin this process's mapping of the segment's payload arena for the GPU
    (once per mapping, however many users); the seconds it took.

    NOTE: cudaHostRegister faults in every page of the arena: it scales with
    the arena (README "GPU hosts" gives the figure per GiB)."""
    span = (int(store.arena_address), int(store.arena_bytes))
    with _lock:
        if _registered.get(span):
            _registered[span] += 1
            return 0.0
        t0 = time.perf_counter()
        extension().register_host(*span)
        _registered[span] = 1
        return time.perf_counter() - t0


def unregister_segment(store: Store) -> None:
    """Drop one user of the registration; the last one unregisters it (before
    the segment is unmapped: pinned pages must never outlive their mapping)."""
    span = (int(store.arena_address), int(store.arena_bytes))
    with _lock:
        n = _registered.get(span, 0)
        if n > 1:
            _registered[span] = n - 1
            return
        _registered.pop(span, None)
        if n:
            extension().unregister_host(span[0])
