"""Copy backends: what moves bytes between a paged KV cache and chunk
payloads, chosen once per KV layout by the device the cache lives on
(`backend_for`), so no copy checks the device again.

  CpuCopy   shmkv._C kernels, synchronous, the GIL released; block windows
            and layer ranges (layer-by-layer pipelining) supported.
  CudaCopy  shmkv._C_cuda, asynchronous on a CUDA stream, by kernels or
            by the copy engines (DMA, batched: holds no SMs, so it overlaps
            compute), chosen per direction (`engines`); the payload must be
            pinned (the segment registered: shmkv.transfer.gpu); layer ranges
            supported (per-layer loads with CUDA events).

`batch(entries)` prepares a step's loads of one layout (CpuBatch, CudaBatch):
on a GPU the slots and payload addresses are checked and uploaded once, then
every layer is one launch for all units (one Python call per layer, not per
unit and layer).

Both take the layout's geometry as one object (shmkv.transfer.layout.LayoutGeometry),
read by the same C++ helper (cpp/paged_layout_py.h). Every index and the
payload size are checked before a byte moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shmkv import _C
from shmkv.errors import InvalidArgumentError
from shmkv.transfer import gpu


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

    def batch(self, entries: list[tuple[np.ndarray, Any, dict[str, Any]]], stream: Any = None) -> CpuBatch:
        """Loads of many payloads, layer by layer (CpuBatch)."""
        return CpuBatch(self, entries)

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


class CpuBatch:
    """A step's loads of one layout on the CPU, copied layer by layer; a unit
    whose copy fails is recorded in `broken` (by its position) and skipped after."""

    def __init__(self, copier: CpuCopy, entries: list[tuple[np.ndarray, Any, dict[str, Any]]]) -> None:
        self._copier = copier
        self._entries = entries
        self.broken: set[int] = set()

    def copy_layer(self, layer: int, stream: Any = None) -> None:
        for k, (idx, payload, options) in enumerate(self._entries):
            if k in self.broken:
                continue
            try:
                self._copier.copy(idx, payload, False, first=options.get("payload_first", 0),
                                  blocks=options.get("payload_blocks", -1), layers=(layer, layer + 1),
                                  part=options.get("part"))
            except Exception:
                self.broken.add(k)

    def release(self, stream: Any = None) -> None:
        self._entries = []


class CudaBatch:
    """A step's loads of one layout on a CUDA device: the slots and payload
    addresses are checked and uploaded once, then each layer is one launch."""

    def __init__(self, copier: CudaCopy, entries: list[tuple[np.ndarray, Any, dict[str, Any]]], stream: Any) -> None:
        if any(options.get("payload_first") or options.get("payload_blocks", -1) >= 0 for _, _, options in entries):
            raise InvalidArgumentError("block windows are CPU-only (the CUDA path copies token payloads)")
        self._copier = copier
        self.broken: set[int] = set()  # a failed launch raises instead: every unit is recomputed
        spans = [(idx, *copier.span(payload, options.get("part"))) for idx, payload, options in entries]
        for _idx, address, nbytes in spans:
            gpu.ensure_registered(address, nbytes)  # pinned before any copy addresses it
        self.dma = copier.use_dma("load", [idx for idx, _, _ in entries], (0, 1))
        self._c = copier._c.prepare_batch(spans, _stream_handle(stream))

    def copy_layer(self, layer: int, stream: Any) -> None:
        self._c.copy_layer(layer, _stream_handle(stream), self.dma)

    def release(self, stream: Any) -> None:
        self._c.release(_stream_handle(stream))


# NOTE: "auto" chooses the copy engines by the mean contiguous run of a copy
# (cpp/copy_kernels.h visit_token_runs: a fragmented block table or a
# head-major layout with few KV heads gives runs of a few KiB). Each DMA costs
# microseconds of engine set-up, so short runs starve the link, while a kernel
# copies any run size at near link speed but holds SMs. Stores are off the
# critical path and should overlap compute: DMA unless runs are short. Loads
# feed the forward that waits for them: DMA only for long runs. Measured on an
# H100 (`python -m shmkv.bench gpu`, two runs, docs/bench/gpu.json): stores of
# 1 KiB runs 0.6-0.7 GB/s by DMA vs 11.5-21.6 by the kernel, of 8 KiB runs
# 2.1-3.7 vs 6.5-7.5, of 64 KiB runs 22-24 vs 34-39, of merged MiB runs 51 vs
# 49 with the kernel slowing a concurrent matmul loop by 20-23 % and DMA by
# 5-7 %; loads of 64 KiB runs 21-22 vs 22-27, of MiB runs about equal.
AUTO_DMA_MIN_RUN = {"store": 16 << 10, "load": 256 << 10}


def choose_dma(direction: str, runs: int, nbytes: int) -> bool:
    """Whether an "auto" copy of `runs` merged runs totalling `nbytes` goes to the copy engines."""
    return runs > 0 and nbytes / runs >= AUTO_DMA_MIN_RUN[direction]


def _stream_handle(stream: Any) -> int:
    return int(getattr(stream, "cuda_stream", stream))


class CudaCopy:
    """Copies of a KV cache on a CUDA device, launched on a stream."""

    on_gpu = True

    def __init__(self, bases: list[int], geometry: Any, device: torch.device) -> None:
        from shmkv.transfer import gpu

        self._host = checked_layout(bases, geometry)  # the same geometry checks as on the CPU; counts runs
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._c = gpu.extension().PagedLayout(bases, geometry, index)
        self.device = device
        self.token_mode = bool(geometry.token_mode)
        self.modes = {"store": "auto", "load": "auto"}

    def engines(self, *, store: str, load: str) -> None:
        """How each direction copies: "dma" (copy engines), "kernel", or
        "auto" (by the copy's merged run size, choose_dma)."""
        for what, v in (("store", store), ("load", load)):
            if v not in ("auto", "dma", "kernel"):
                raise InvalidArgumentError(f"{what} copy engine {v!r}: expected auto, dma or kernel")
        self.modes = {"store": store, "load": load}

    def use_dma(self, direction: str, indices: list[np.ndarray], layers: tuple[int, int]) -> bool:
        """Whether a copy of these index arrays (one per payload) goes to the copy engines."""
        mode = self.modes[direction]
        if mode != "auto":
            return mode == "dma"
        if not self.token_mode:
            return True  # whole blocks: long runs
        # NOTE: every layer of a layout has one geometry: the first layer's runs say the mean run
        # of them all (walking every layer cost 15 us per 256-token unit of a 32-layer rank)
        first = layers[0]
        runs = nbytes = 0
        for idx in indices:
            r, n = self._host.token_copy_runs(idx, first, first + 1)
            runs, nbytes = runs + r, nbytes + n
        return choose_dma(direction, runs, nbytes)

    def copy(self, idx: np.ndarray, payload: Any, gather: bool, *, stream: Any = None, first: int = 0,
             blocks: int = -1, layers: tuple[int, int] | None = None, part: tuple[int, int] | None = None) -> None:
        """Asynchronous: keep the payload's lease or reservation until the stream has passed it."""
        if first or blocks >= 0:
            raise InvalidArgumentError("block windows are CPU-only (the CUDA path copies token payloads)")
        l0, l1 = layers if layers is not None else (0, -1)
        address, nbytes = self.span(payload, part)
        gpu.ensure_registered(address, nbytes)  # pinned before any copy addresses it
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        dma = self.use_dma("store" if gather else "load", [idx], (l0, l1))
        self._c.copy(gather, idx, address, nbytes, _stream_handle(stream), l0, l1, dma)

    @staticmethod
    def span(payload: Any, part: tuple[int, int] | None = None) -> tuple[int, int]:
        """(address, bytes) of a payload (a lease, a reservation or a host tensor), or of its `part`."""
        if isinstance(payload, torch.Tensor):
            address, nbytes = payload.data_ptr(), payload.numel() * payload.element_size()
        else:
            address, nbytes = int(payload.address), int(payload.size)
        if part is not None:
            off, n = part
            if off < 0 or n < 0 or off + n > nbytes:
                raise InvalidArgumentError(f"payload part [{off}, {off + n}) is outside the {nbytes}-byte payload")
            address, nbytes = address + off, n
        return address, nbytes

    def batch(self, entries: list[tuple[np.ndarray, Any, dict[str, Any]]], stream: Any) -> CudaBatch:
        """Loads of many payloads, one launch per layer (CudaBatch)."""
        return CudaBatch(self, entries, stream)


def backend_for(device: torch.device, bases: list[int], geometry: Any) -> CpuCopy | CudaCopy:
    """The copy backend of a KV cache on `device`."""
    if device.type == "cuda":
        return CudaCopy(bases, geometry, device)
    if device.type != "cpu":
        raise InvalidArgumentError(f"shmkv copies KV caches on CPU or CUDA devices, not {device.type}")
    return CpuCopy(bases, geometry)
