"""GPU side of the segment: every process whose KV cache is on a CUDA device
registers its mapping of the segment's payload arena with cudaHostRegister
(pinned, mapped), so the CUDA copy backend (shmkv.copy_backends.CudaCopy)
addresses payloads directly.

Imported only for a KV cache on a CUDA device; a CPU-only process never
loads shmkv._C_cuda.
"""

from __future__ import annotations

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


def register_segment(store: Store) -> None:
    """Pin this process's mapping of the segment's payload arena for the GPU."""
    extension().register_host(store.arena_address, store.arena_bytes)


def unregister_segment(store: Store) -> None:
    extension().unregister_host(store.arena_address)
