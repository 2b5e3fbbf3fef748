"""GPU side of the segment: every process whose KV cache is on a CUDA device
registers its mapping of the segment's payload arena with cudaHostRegister
(pinned, mapped), so the CUDA copy backend (shmkv.transfer.copy_backends.CudaCopy)
addresses payloads directly. The arena is pinned a slice at a time: the
first before the engine serves, the rest in the background as the segment
reserves them; a copy first makes sure its slices are pinned.

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


SLICE_BYTES = 1 << 30  # the arena is pinned a slice at a time (cudaHostRegister of one slice: ~0.3 s on 4 KiB pages)
RESERVE_POLL_S = 0.05  # how often the registering thread looks whether more of the arena is reserved
_NONE, _PINNING, _DONE = 0, 1, 2  # a slice's state


class _Registration:
    """One mapping of a segment's arena, pinned for the GPU a slice at a
    time: the first slice before register_segment returns, the rest by a
    thread of its own in address order, and never past what the segment has
    reserved (pinning faults pages in: the daemon's background reservation
    owns them, not this process). A copy that touches a slice not pinned yet
    pins it first (ensure_registered): no copy ever addresses unpinned memory.

    Invariants: a slice goes NONE -> PINNING -> DONE under `cv` (back to
    NONE if pinning failed), is pinned once and by one thread (others wait
    for it), and no lock is held while the CUDA part pins; unregister()
    stops the thread first, then unpins every DONE slice."""

    def __init__(self, store: Store, span: tuple[int, int]) -> None:
        self.store, (self.base, self.bytes) = store, span
        self.slices = max(1, -(-self.bytes // SLICE_BYTES))
        self.state = [_NONE] * self.slices
        self.users = 1
        self.cv = threading.Condition()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.all_done = False
        self.error: BaseException | None = None

    def _range(self, i: int) -> tuple[int, int]:
        lo = i * SLICE_BYTES
        return self.base + lo, min(SLICE_BYTES, self.bytes - lo)

    def _reserved(self) -> int:
        try:
            return int(self.store.stats()["arena_reserved_bytes"])
        except Exception:  # noqa: BLE001 - a closing store: the thread stops
            return self.bytes

    def register(self, i: int) -> None:
        """Pin slice i (if not yet; waits for another thread pinning it): the caller may then address it."""
        with self.cv:
            while self.state[i] == _PINNING:
                self.cv.wait()
            if self.state[i] == _DONE:
                return
            self.state[i] = _PINNING
        try:
            extension().register_host(*self._range(i))  # releases the GIL while it pins
        except BaseException:
            with self.cv:
                self.state[i] = _NONE
                self.cv.notify_all()
            raise
        with self.cv:
            self.state[i] = _DONE
            self.all_done = all(st == _DONE for st in self.state)
            self.cv.notify_all()

    def start(self) -> None:
        self.register(0)
        if self.slices > 1:
            self.thread = threading.Thread(target=self._run, name="shmkv-pin", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            for i in range(1, self.slices):
                lo, n = i * SLICE_BYTES, self._range(i)[1]
                while not self.stop.is_set() and self._reserved() < min(self.bytes, lo + n):
                    self.stop.wait(RESERVE_POLL_S)  # the daemon (or this process) is still reserving
                if self.stop.is_set():
                    return
                self.register(i)
        except BaseException as e:  # noqa: BLE001 - kept for the next copy to raise, never lost
            self.error = e

    def ensure(self, address: int, nbytes: int) -> None:
        """Pin every slice [address, address + nbytes) touches that is not pinned yet."""
        if self.all_done:
            return
        first = (address - self.base) // SLICE_BYTES
        last = (address + max(nbytes, 1) - 1 - self.base) // SLICE_BYTES
        for i in range(max(0, first), min(self.slices - 1, last) + 1):
            if self.state[i] != _DONE:
                self.register(i)

    def unregister(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        with self.cv:
            while _PINNING in self.state:  # a copy's pin in flight ends first
                self.cv.wait()
            for i, st in enumerate(self.state):
                if st == _DONE:
                    extension().unregister_host(self._range(i)[0])
                    self.state[i] = _NONE
            self.all_done = False


# This process's registrations: (address, bytes) -> its registration. A range
# is registered once, by its first user, and unregistered by its last.
_registered: dict[tuple[int, int], _Registration] = {}
_lock = threading.Lock()


def register_segment(store: Store, *, wait: bool = False) -> float:
    """Pin this process's mapping of the segment's payload arena for the GPU
    (once per mapping, however many users); the seconds it took. The first
    slice is pinned before this returns, the rest in the background (`wait`:
    all of it now, as a benchmark of pinning wants).

    NOTE: cudaHostRegister faults in every page it pins: it scales with the
    arena (docs/install.md "GPU hosts" gives the figure per GiB; huge pages cut it)."""
    span = (int(store.arena_address), int(store.arena_bytes))
    with _lock:
        reg = _registered.get(span)
        if reg is not None:
            reg.users += 1
            return 0.0
        t0 = time.perf_counter()
        reg = _Registration(store, span)
        reg.start()
        _registered[span] = reg
    if wait:
        for i in range(reg.slices):
            reg.register(i)
    return time.perf_counter() - t0


def ensure_registered(address: int, nbytes: int) -> None:
    """Before a copy addresses [address, address + nbytes) of a segment: the
    slices it touches are pinned (pinned now if the background has not
    reached them). Memory outside every registered segment is left alone
    (a host tensor of a test, pinned by torch)."""
    for (base, size), reg in list(_registered.items()):
        if base <= address < base + size:
            if reg.error is not None:
                raise reg.error
            reg.ensure(address, nbytes)
            return


def unregister_segment(store: Store) -> None:
    """Drop one user of the registration; the last one stops the background
    pinning and unregisters every slice (before the segment is unmapped:
    pinned pages must never outlive their mapping)."""
    span = (int(store.arena_address), int(store.arena_bytes))
    with _lock:
        reg = _registered.get(span)
        if reg is None:
            return
        reg.users -= 1
        if reg.users > 0:
            return
        _registered.pop(span, None)
    reg.unregister()
