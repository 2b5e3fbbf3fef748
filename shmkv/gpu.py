"""GPU side of the copies: CUDA gather/scatter between a device KV cache and
payloads in the shmkv segment, which every GPU process registers with
cudaHostRegister (pinned, mapped) so kernels address it directly.

Imported only when a layout lives on a CUDA device; a CPU-only process never
loads shmkv._C_cuda.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shmkv.errors import InvalidArgumentError

if TYPE_CHECKING:
    from shmkv.layout import KVLayout
    from shmkv.store import Store


def _ext() -> Any:
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
    _ext().register_host(store.arena_address, store.arena_bytes)


def unregister_segment(store: Store) -> None:
    _ext().unregister_host(store.arena_address)


def paged_copy(layout: KVLayout, idx: np.ndarray, payload: Any, gather: bool, stream: Any,
               part: tuple[int, int] | None = None) -> None:
    """Launch the copy on `stream` (a torch.cuda.Stream, a raw handle, or None
    for the current stream). Asynchronous: keep the payload's lease or
    reservation until the stream has passed it. `part` = (offset, bytes) of
    the payload this copy covers."""
    if isinstance(payload, torch.Tensor):
        address, nbytes = payload.data_ptr(), payload.numel() * payload.element_size()
    else:
        address, nbytes = int(payload.address), int(payload.size)
    if part is not None:
        off, n = part
        if off < 0 or n < 0 or off + n > nbytes:
            raise InvalidArgumentError(f"payload part [{off}, {off + n}) is outside the {nbytes}-byte payload")
        address, nbytes = address + off, n
    if stream is None:
        stream = torch.cuda.current_stream(layout.device)
    handle = int(getattr(stream, "cuda_stream", stream))
    g = layout.geometry
    _ext().paged_copy(
        layout._bases, g.num_blocks, g.block_stride, g.block_bytes, g.block_size, g.token_mode,
        g.token_stride, g.runs_i, g.stride_i, g.runs_j, g.stride_j, g.run_bytes,
        gather, idx.tolist(), address, nbytes, handle,
    )
