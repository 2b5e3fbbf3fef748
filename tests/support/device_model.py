"""A test backend of shmkv.transfer.streams that behaves like a device, and
a checker of the order it allows.

On the CPU backend a wait runs the copies it waits for, so a missing or late
fence cannot fail a CPU test. Here nothing runs when it is issued: the
compute is a stream too (what a runner issues through `compute`), a wait
(`compute_waits`, `after_compute`) only records that later work on a stream
depends on an event, and an operation runs at the latest point the recorded
dependencies allow: when the host synchronizes on something that depends on
it, or (seeded) when the host polls an event. Among the operations a point
forces, the order is any the dependencies allow (seeded), as on a device
whose streams race.

The checker (happens-before by vector clocks, FastTrack-style per block):
every operation names the KV blocks it reads and writes (`touches`: the
transfer engine's copies, the runner's forward, zeroing, copy-on-write,
state pre-copy). When an operation is issued, every earlier access to the
same block by another operation that conflicts with it (one of the two
writes) must happen before it: on the same stream, through an event it was
made to wait for, or through an event the host saw complete before it was
issued. Otherwise a Violation names the block, both operations and their
steps. The checker looks at dependencies, not at the order the model picked:
a race is reported even when the seeded order happened to be harmless.

Invariants:
  * an operation runs once, after every operation it depends on;
  * an event's query() is True only once everything before it on its stream ran;
  * host observations (synchronize, a query that answered True) order every
    operation issued afterwards after the observed event.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

Touch = tuple[Any, Iterable[int], str]  # (tensor, block ids, "r" | "w" | "rw")


@dataclass(eq=False)
class Op:
    """One operation of a stream (or an event marker when fn is None)."""

    stream: ModelStream
    seq: int
    label: str
    step: int
    fn: Callable[[], None] | None
    deps: list[Op]
    vc: dict[str, int]
    done: bool = False
    error: BaseException | None = None

    def __repr__(self) -> str:
        return f"{self.stream.name}#{self.seq} {self.label!r} (step {self.step})"


@dataclass(frozen=True)
class Violation:
    block: str
    earlier: str
    later: str

    def __str__(self) -> str:
        return f"block {self.block}: {self.later} is not ordered after {self.earlier}"


class ModelEvent:
    """A point of a ModelStream: complete once it and everything before it on the stream ran."""

    def __init__(self, op: Op) -> None:
        self.op = op
        self.error: BaseException | None = None  # a copy before it (since the previous event) failed

    def query(self) -> bool:
        dev = self.op.stream.device
        if not self.op.done and dev.rng.random() < dev.query_progress:
            dev.run_until(self.op)
        if self.op.done:
            dev.observe(self.op)
        return self.op.done

    def synchronize(self) -> None:
        dev = self.op.stream.device
        dev.run_until(self.op)
        dev.observe(self.op)


class ModelStream:
    """Operations in issue order, run only when something forces them."""

    native = None  # what the copy backends take as a stream (the copies run on host tensors)

    def __init__(self, name: str, device: DeviceModel) -> None:
        self.name = name
        self.device = device
        self.last: Op | None = None
        self._waits: list[Op] = []  # cross-stream dependencies of the next operation
        self._seq = 0
        self._error: BaseException | None = None  # of a copy since the last event

    def run(self, copy: Callable[[Any], None], touches: Sequence[Touch] = (), label: str = "copy") -> Op:
        """Queue a copy (it runs after everything issued before on this stream)."""
        return self._issue(lambda: copy(None), touches, label)

    def record(self) -> ModelEvent:
        ev = ModelEvent(None)  # type: ignore[arg-type]

        def mark() -> None:
            ev.error, self._error = self._error, None

        ev.op = self._issue(mark, (), "event", marker=True)
        return ev

    def discard(self, ops: Sequence[Op]) -> None:
        """What `ops` produce is thrown away (a store aborted): a race they are in corrupts nothing."""
        self.device.discard(ops)

    def wait(self, ev: ModelEvent) -> None:
        """Later operations of this stream come after `ev` (cudaStreamWaitEvent:
        itself a point of the stream, which other streams may wait for)."""
        self._waits.append(ev.op)
        self._issue(lambda: None, (), f"wait for {ev.op!r}", marker=True)

    def after_compute(self) -> None:
        """The next operations come after the compute issued so far."""
        last = self.device.compute_stream.last
        if last is not None:
            self._waits.append(last)

    def close(self) -> None:
        if self.last is not None:
            self.device.run_until(self.last)

    def _issue(self, fn: Callable[[], None], touches: Sequence[Touch], label: str, *, marker: bool = False) -> Op:
        dev = self.device
        self._seq += 1
        deps = ([self.last] if self.last is not None else []) + self._waits
        self._waits = []
        vc = dict(dev.host_vc)
        for d in deps:
            _join(vc, d.vc)
        vc[self.name] = self._seq
        op = Op(self, self._seq, label, dev.step, fn, deps, vc)
        if not marker:
            inner = fn

            def guarded() -> None:
                try:
                    inner()
                except BaseException as e:  # carried by the stream's next event, as the CPU backend does
                    op.error = e
                    if self._error is None:
                        self._error = e

            op.fn = guarded
        self.last = op
        dev.ops.append(op)
        for tensor, ids, mode in touches:
            dev.check(op, tensor, ids, mode)
        return op


def _join(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _before(a: Op, b: Op) -> bool:
    return a.vc[a.stream.name] <= b.vc.get(a.stream.name, 0)


@dataclass
class _BlockState:
    label: str
    write: Op | None = None
    reads: dict[str, Op] = field(default_factory=dict)  # latest read per stream since the write


class DeviceModel:
    """The backend: `stream(name)` for the transfer engine, `compute_stream`
    and `compute(...)` for the runner, `compute_waits(ev)` as a device's.

    `seed` picks the order among operations a point forces and whether a
    polled event has progressed (`query_progress`: the chance it runs what
    it waits for when polled; 0: only synchronizations run anything).
    Violations are collected in `violations`."""

    on_gpu = False
    tracks_blocks = True

    def __init__(self, seed: int = 0, *, query_progress: float = 0.5) -> None:
        self.rng = random.Random(seed)
        self.query_progress = query_progress
        self.step = 0  # the runner's step: named in violations
        self.host_vc: dict[str, int] = {}
        self.ops: list[Op] = []  # every operation not yet run, and some that did (pruned)
        self.violations: list[Violation] = []
        self._blocks: dict[int, _BlockState] = {}  # by the block's address
        self._streams: dict[str, ModelStream] = {}
        self._discarded: set[int] = set()  # ids of operations whose results are thrown away
        self._names: dict[int, str] = {}  # a tensor's address -> its name in violations
        self.compute_stream = self.stream("compute")

    # ------------------------------------------------- backend interface --
    def stream(self, name: str) -> ModelStream:
        base, n = name, 1
        while name in self._streams:
            n += 1
            name = f"{base}{n}"
        s = self._streams[name] = ModelStream(name, self)
        return s

    def compute_waits(self, ev: ModelEvent) -> None:
        """Later compute comes after `ev`; nothing runs now."""
        self.compute_stream.wait(ev)

    @staticmethod
    def capturing() -> bool:
        """No CUDA graph is ever captured here."""
        return False

    # ---------------------------------------------------- runner interface --
    def name_tensor(self, tensor: Any, name: str) -> None:
        """How violations name the blocks of `tensor` (a layer's KV cache)."""
        self._names.setdefault(int(tensor.data_ptr()), name)

    def compute(self, label: str, fn: Callable[[], None] | None = None, touches: Sequence[Touch] = ()) -> Op:
        """Issue compute (a layer's forward, zeroing, a copy-on-write, a state pre-copy)."""
        return self.compute_stream._issue(fn or (lambda: None), touches, label)

    def sync_compute(self) -> None:
        """The host waits for the compute issued so far (vLLM reads the sampled tokens)."""
        last = self.compute_stream.last
        if last is not None:
            self.run_until(last)
            self.observe(last)

    def synchronize(self) -> None:
        """Run everything (torch.cuda.synchronize)."""
        self._run([op for op in self.ops if not op.done])
        for s in self._streams.values():
            if s.last is not None:
                self.observe(s.last)

    def progress(self, fraction: float = 0.5) -> None:
        """The device gets ahead on its own: run a seeded share of what could run."""
        pending = [op for op in self.ops if not op.done]
        for op in pending:
            if not op.done and self.rng.random() < fraction:
                self.run_until(op)

    # ------------------------------------------------------------ model --
    def run_until(self, target: Op) -> None:
        """Run `target` and everything it depends on, in a seeded order the dependencies allow."""
        need: list[Op] = []
        seen: set[int] = set()
        stack = [target]
        while stack:
            op = stack.pop()
            if op.done or id(op) in seen:
                continue
            seen.add(id(op))
            need.append(op)
            stack.extend(op.deps)
        self._run(need)

    def _run(self, need: list[Op]) -> None:
        while need:
            ready = [op for op in need if all(d.done for d in op.deps)]
            op = ready[self.rng.randrange(len(ready))]
            need.remove(op)
            if op.fn is not None:
                op.fn()
            op.done = True
            # NOTE: the checker keeps run operations (the last accesses of each block) by their
            # clocks alone: their closures (a store's reservation, a load's batch: views of the
            # segment) and their chains of dependencies go, or a test's segments stay mapped
            op.fn, op.deps = None, []
        self.ops = [op for op in self.ops if not op.done]

    def observe(self, op: Op) -> None:
        """The host saw `op` complete: everything issued from now on is after it."""
        _join(self.host_vc, op.vc)

    def check(self, op: Op, tensor: Any, ids: Iterable[int], mode: str) -> None:
        """Record `op`'s access to blocks `ids` (indices of `tensor`'s first dim) and check its order."""
        base, stride = int(tensor.data_ptr()), tensor.stride(0) * tensor.element_size()
        name = self._names.get(base, hex(base))
        reads, writes = "r" in mode, "w" in mode
        for b in ids:
            key = base + int(b) * stride  # the block's address: layers sharing a buffer share blocks
            st = self._blocks.get(key)
            if st is None:
                st = self._blocks[key] = _BlockState(f"{name}[{int(b)}]")
            if st.write is not None and st.write is not op and not _before(st.write, op):
                self._violate(st.label, st.write, op)
            if writes:
                for r in st.reads.values():
                    if r is not op and not _before(r, op):
                        self._violate(st.label, r, op)
                st.write, st.reads = op, {}
            elif reads:
                st.reads[op.stream.name] = op

    def discard(self, ops: Sequence[Op]) -> None:
        """`ops`' results are thrown away: races they are in are no violations."""
        gone = {repr(op) for op in ops}
        self._discarded |= {id(op) for op in ops}
        self.violations = [v for v in self.violations if v.earlier not in gone and v.later not in gone]

    def _violate(self, block: str, earlier: Op, later: Op) -> None:
        if id(earlier) in self._discarded or id(later) in self._discarded:
            return
        v = Violation(block, repr(earlier), repr(later))
        if v in self.violations:
            return
        self.violations.append(v)

