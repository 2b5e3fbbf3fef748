"""Copy backends: what moves bytes between a paged KV cache and chunk
payloads, chosen once per KV layout by the device the cache lives on
(`backend_for`), so no copy checks the device again.

  CpuCopy   shmkv._C kernels, synchronous, the GIL released; block windows
            and layer ranges (layer-by-layer pipelining) supported.
  CudaCopy  shmkv._C_cuda, asynchronous on a CUDA stream, by kernels or
            by the copy engines (DMA, batched: holds no SMs, so it overlaps
            compute), chosen per direction (`engines`); the payload must be
            pinned (the segment registered: shmkv.gpu); layer ranges
            supported (per-layer loads with CUDA events).

Both take the layout's geometry as one object (shmkv.layout.LayoutGeometry),
read by the same C++ helper (cpp/paged_layout_py.h). Every index and the
payload size are checked before a byte moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shmkv import _C
from shmkv.errors import InvalidArgumentError


def as_index(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise InvalidArgumentError(f"{what} must hold integers, got {x.dtype}")
        x = x.detach().to("cpu", torch.int64).numpy()
    arr = np.asarray(x)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"{what} must hold integers, got {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what} must be 1-D, got shape {arr.shape}")
    return arr


def as_payload(x: Any, part: tuple[int, int] | None = None) -> Any:
    """A buffer-protocol object for a payload: shmkv leases/reservations,
    numpy arrays, bytearrays, or CPU torch tensors (viewed as bytes);
    `part` = (offset, bytes) narrows it to that byte range."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise InvalidArgumentError("a tensor payload must live in CPU memory")
        if not x.is_contiguous():
            raise InvalidArgumentError("a tensor payload must be contiguous")
        buf = x.detach().view(torch.uint8).reshape(-1).numpy()
    else:
        buf = getattr(x, "_c", x)  # shmkv.store Lease/Reservation -> their C++ buffer
    if part is None:
        return buf
    off, n = part
    mv = memoryview(buf).cast("B")
    if off < 0 or n < 0 or off + n > len(mv):
        raise InvalidArgumentError(f"payload part [{off}, {off + n}) is outside the {len(mv)}-byte payload")
    return mv[off:off + n]


def checked_layout(bases: list[int], geometry: Any) -> Any:
    """The C++ layout of a geometry, or InvalidArgumentError saying why shmkv cannot copy it."""
    try:
        return _C.PagedLayout(bases, geometry)
    except ValueError as e:
        raise InvalidArgumentError(f"shmkv cannot copy this KV-cache layout: {e}") from e


class CpuCopy:
    """Copies of a KV cache in host memory."""

    on_gpu = False

    def __init__(self, bases: list[int], geometry: Any) -> None:
        self._c = checked_layout(bases, geometry)
        self.token_mode = bool(geometry.token_mode)

    def copy(self, idx: np.ndarray, payload: Any, gather: bool, *, stream: Any = None, first: int = 0,
             blocks: int = -1, layers: tuple[int, int] | None = None, part: tuple[int, int] | None = None) -> None:
        l0, l1 = layers if layers is not None else (0, -1)
        buf = as_payload(payload, part)
        if self.token_mode:
            if first or blocks >= 0:
                raise InvalidArgumentError("payload_first/payload_blocks apply to block layouts only")
            (self._c.gather_tokens if gather else self._c.scatter_tokens)(idx, buf, l0, l1)
        else:
            (self._c.gather_blocks if gather else self._c.scatter_blocks)(idx, buf, first, blocks, l0, l1)


class CudaCopy:
    """Copies of a KV cache on a CUDA device, launched on a stream."""

    on_gpu = True

    def __init__(self, bases: list[int], geometry: Any, device: torch.device) -> None:
        from shmkv import gpu

        checked_layout(bases, geometry)  # the same geometry checks as on the CPU
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._c = gpu.extension().PagedLayout(bases, geometry, index)
        self.device = device
        self.dma_gather, self.dma_scatter = True, False  # stores by the copy engines, loads by kernels

    def engines(self, *, store: str, load: str) -> None:
        """How each direction copies: "dma" (copy engines) or "kernel"."""
        for what, v in (("store", store), ("load", load)):
            if v not in ("dma", "kernel"):
                raise InvalidArgumentError(f"{what} copy engine {v!r}: expected dma or kernel")
        self.dma_gather, self.dma_scatter = store == "dma", load == "dma"

    def copy(self, idx: np.ndarray, payload: Any, gather: bool, *, stream: Any = None, first: int = 0,
             blocks: int = -1, layers: tuple[int, int] | None = None, part: tuple[int, int] | None = None) -> None:
        """Asynchronous: keep the payload's lease or reservation until the stream has passed it."""
        if first or blocks >= 0:
            raise InvalidArgumentError("block windows are CPU-only (the CUDA path copies token payloads)")
        l0, l1 = layers if layers is not None else (0, -1)
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
            stream = torch.cuda.current_stream(self.device)
        self._c.copy(gather, idx.tolist(), address, nbytes, int(getattr(stream, "cuda_stream", stream)), l0, l1,
                     self.dma_gather if gather else self.dma_scatter)


def backend_for(device: torch.device, bases: list[int], geometry: Any) -> CpuCopy | CudaCopy:
    """The copy backend of a KV cache on `device`."""
    if device.type == "cuda":
        return CudaCopy(bases, geometry, device)
    if device.type != "cpu":
        raise InvalidArgumentError(f"shmkv copies KV caches on CPU or CUDA devices, not {device.type}")
    return CpuCopy(bases, geometry)
