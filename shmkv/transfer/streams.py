"""Where the transfer engine's copies run: streams of copies in issue order,
and events that mark a point of a stream. One interface, two backends:

  CudaBackend  a torch CUDA stream per direction; `run` launches the copies
               on it at once (launch errors raise there), `record` records a
               CUDA event; `compute_waits` makes the compute stream wait on
               an event (the host never waits).
  CpuBackend   a copy thread per direction (moved off the cores of vLLM's
               OpenMP pool), running the copies in FIFO order; `record`
               queues a completion flag; `compute_waits` blocks the host
               (on the CPU the host is the compute stream).

Everything above this (pending stores, commits on completion, lease release,
delayed frees, preemption ordering, error accounting: shmkv.transfer.engine)
is one code path over this interface, so the CPU runs of the test suite drive
the same bookkeeping a GPU host runs.

Invariants:
  * copies of one stream run in the order they were issued, and an event is
    complete only when everything issued before it on its stream has run;
  * a copy that fails on the CPU thread does not stop the stream: its error
    is carried by the next event recorded on that stream (`event.error`),
    the way a CUDA launch error is raised by `run` itself;
  * tests/support/device_model.py is a third backend: a device
    whose copies run as late as the recorded dependencies allow, with a
    checker of the order of every access to a KV block;
  * `deferred=True` (tests only) runs a CPU stream's copies on the thread
    that waits for one of its events, never before: copies stay in flight,
    deterministically, for as long as a test needs.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("shmkv.transfer")

Copy = Callable[[Any], None]  # called with the backend's stream handle (None on the CPU)


def _avoid_cores_of_the_main_thread() -> None:
    """Move the calling thread to the CPUs its creator is not bound to: vLLM
    binds the worker's OpenMP threads (and so the threads it starts) to its
    compute cores; a copy thread there would only steal from the forward."""
    try:
        mine = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - mine
        if others:
            os.sched_setaffinity(0, others)
    except OSError:
        pass


class CpuEvent:
    """A point of a CpuStream: complete once every copy issued before it ran."""

    __slots__ = ("_flag", "_stream", "error")

    def __init__(self, stream: CpuStream) -> None:
        self._flag = threading.Event()
        self._stream = stream
        self.error: BaseException | None = None  # a copy before it (since the last event) failed

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        if not self._flag.is_set():
            self._stream._wait(self)


class CpuStream:
    """Copies run in issue order by one thread (or, deferred, by a waiter)."""

    native = None  # what the copy backends take as a stream (the CPU has none)

    def __init__(self, name: str, *, deferred: bool = False) -> None:
        self.name = name
        self.deferred = deferred
        self._error: BaseException | None = None
        self._tasks: deque = deque()  # deferred: (copy or None, event or None)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def run(self, copy: Copy, touches: Any = (), label: str = "") -> None:
        """Queue a copy (it runs after everything queued before). `touches`
        and `label` are for a backend that checks the order (device_model)."""
        self._put((copy, None))

    def record(self) -> CpuEvent:
        ev = CpuEvent(self)
        self._put((None, ev))
        return ev

    def after_compute(self) -> None:
        """Order the next copies after the compute issued so far: nothing to do
        on the CPU (vLLM's CPU forward has returned before a copy is issued)."""

    def wait(self, ev: CpuEvent) -> None:
        """The next copies run only after `ev` (of another stream) completed."""
        self._put((lambda _: ev.synchronize(), None))

    def _put(self, task: tuple) -> None:
        if self.deferred:
            self._tasks.append(task)
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"shmkv-{self.name}", daemon=True)
                self._thread.start()
        self._queue.put(task)

    def _do(self, task: tuple) -> None:
        copy, ev = task
        if ev is not None:
            ev.error, self._error = self._error, None
            ev._flag.set()
            return
        try:
            copy(None)
        except BaseException as e:  # carried by the next event: the engine accounts for it
            if self._error is None:
                self._error = e

    def _loop(self) -> None:
        _avoid_cores_of_the_main_thread()
        while True:
            task = self._queue.get()
            if task is None:
                return
            self._do(task)

    def _wait(self, ev: CpuEvent) -> None:
        if self.deferred:
            while not ev._flag.is_set() and self._tasks:
                self._do(self._tasks.popleft())
            if not ev._flag.is_set():
                raise RuntimeError(f"event of stream {self.name} was never recorded")
            return
        ev._flag.wait()

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        if self.deferred:
            while self._tasks:
                self._do(self._tasks.popleft())
            return
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._queue.put(None)
            t.join()


class CpuBackend:
    """Copies of a KV cache in host memory, off the thread that runs vLLM."""

    on_gpu = False

    def __init__(self, *, deferred: bool = False) -> None:
        self.deferred = deferred

    def stream(self, name: str) -> CpuStream:
        return CpuStream(name, deferred=self.deferred)

    @staticmethod
    def compute_waits(ev: CpuEvent) -> None:
        """The compute (the calling host thread) goes on only after `ev`."""
        ev.synchronize()

    @staticmethod
    def capturing() -> bool:
        """Whether the compute is being recorded into a CUDA graph (never on the CPU)."""
        return False


class CudaEvent:
    __slots__ = ("_ev", "error")

    def __init__(self, ev: Any) -> None:
        self._ev = ev
        self.error: BaseException | None = None  # CUDA launch errors raise in run() instead

    def query(self) -> bool:
        return bool(self._ev.query())

    def synchronize(self) -> None:
        self._ev.synchronize()


class CudaStream:
    def __init__(self, name: str, device: Any) -> None:
        import torch

        self.name = name
        self.device = device
        self._s = torch.cuda.Stream(device)
        self.native = self._s  # what the copy backends take as a stream

    @property
    def handle(self) -> int:
        return int(self._s.cuda_stream)

    def run(self, copy: Copy, touches: Any = (), label: str = "") -> None:
        """Launch the copies now, on this stream (asynchronous)."""
        import torch

        with torch.cuda.stream(self._s):
            copy(self._s)

    def record(self) -> CudaEvent:
        import torch

        ev = torch.cuda.Event()
        ev.record(self._s)
        return CudaEvent(ev)

    def after_compute(self) -> None:
        """NOTE: the copies issued next must see what the compute stream wrote
        (stores) and must not overwrite blocks it still reads (loads)."""
        import torch

        self._s.wait_stream(torch.cuda.current_stream(self.device))

    def wait(self, ev: CudaEvent) -> None:
        """The next copies run only after `ev` (of another stream): on the device."""
        self._s.wait_event(ev._ev)

    def close(self) -> None:
        self._s.synchronize()


class CudaBackend:
    on_gpu = True

    def __init__(self, device: Any) -> None:
        self.device = device

    def stream(self, name: str) -> CudaStream:
        return CudaStream(name, self.device)

    def compute_waits(self, ev: CudaEvent) -> None:
        """The compute stream waits on the device; the host goes on."""
        import torch

        torch.cuda.current_stream(self.device).wait_event(ev._ev)

    @staticmethod
    def capturing() -> bool:
        """Whether the compute is being recorded into a CUDA graph (vLLM's
        capture at start-up runs the forward's hooks): no copy is issued then."""
        import torch

        return bool(torch.cuda.is_current_stream_capturing())


def backend_for(device: Any, *, deferred: bool = False) -> CpuBackend | CudaBackend:
    """The streams of a KV cache on `device` (a torch.device)."""
    if getattr(device, "type", "cpu") == "cuda":
        return CudaBackend(device)
    return CpuBackend(deferred=deferred)
