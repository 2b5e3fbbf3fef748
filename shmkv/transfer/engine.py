"""The transfer engine: moves units between one worker's paged KV cache and
the shared segment, asynchronously on every platform. Knows nothing of vLLM
(shaped like vLLM's OffloadingWorker): submit loads and stores, per-layer
readiness of loads, poll for completed work, and an ordering barrier
(compute after the pending stores).

One code path above the copy primitive (shmkv.transfer.streams): a CUDA
stream and events on a GPU, a copy thread and completion flags on the CPU.

  loads   submit_load acquires the leases, plans and uploads the batch's
          copies once, then issues the first few layers' copies
          (every unit of the batch, one call per layer) on the load stream,
          each followed by an event, and returns: the forward's launch does
          not wait for the host to issue every layer. The rest are issued in
          forward order as the forward goes: LoadJob.wait_layer(name) issues
          every job's copies up to load_issue_ahead layers past that layer
          (its own job first), then makes the compute wait on that layer's
          event; wait_all, done and synchronize issue all that is left. The
          leases are released once the last event has completed (poll),
          never by blocking the host.
  stores  submit_store reserves each unit's room, issues its gather on the
          store stream after the compute, and records an event after each
          request's units (one per request of the step, not per unit). poll
          commits a store whose event has completed, or aborts it if any of
          its copies failed: never while a copy issued for it may still run
          (a freed extent is never written). Until then its source blocks
          must stay untouched: `pending_requests` says whose, and
          `order_compute_after_stores` / `order_compute_after` order the
          compute after them, or `doom` aborts them (the caller's choice once
          vLLM gives their blocks out again: preemption, sliding windows).

Nothing here raises into the caller for a unit: a unit that cannot be loaded
(evicted since the lookup, lease gone stale, a failed copy) reports its
blocks as failed and is recomputed; a unit that cannot be stored (store
full, another process writing it, a failed copy) is skipped. Every such path
has a counter. A hybrid model's KV cache is several groups, each with its
own block ids; a group whose layers differ in shape (vLLM's
UniformTypeKVCacheSpecs: a drafter of another head size in the target's
group, per-layer head counts) is several layouts, one per shape, over the
same block ids. A unit's payload is the layouts' sections in layout order,
each `[layers of the layout][its stored blocks][block bytes]` (or per token).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from shmkv.errors import InvalidArgumentError
from shmkv.store import PutResult, Reservation, Store
from shmkv.testing import SKIP_LOAD_LAYERS
from shmkv.tiers.format import DamagedChunk, decode_into
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem
from shmkv.transfer.layout import KVLayout
from shmkv.transfer.streams import backend_for

log = logging.getLogger("shmkv.transfer")

# NOTE: layers whose load copies are in flight ahead of the layer the forward waits for: enough that
# the load stream never runs dry while the host launches a layer (CPU: while it computes one), few
# enough that start_load_kv returns after a handful of launches, not after every layer's
LOAD_ISSUE_AHEAD = 4


@dataclass
class StoreJob:
    """One unit being stored: its room, and the event after its copies."""

    item: StoreItem
    reservation: Reservation
    namespace: bytes | None
    t0: float
    event: Any = None
    failed: bool = False  # a copy could not be issued: aborted once the event completes
    doomed: str = ""  # why its bytes cannot be trusted (its blocks were rewritten): aborted too
    seconds: float = 0.0  # from issue to commit (or abort)
    blocks: frozenset[int] = frozenset()  # vLLM block ids its gathers read
    ops: list[Any] = field(default_factory=list)  # its copies, as a checking backend returns them


@dataclass
class RequestTally:
    stored_tokens: int = 0
    stored_units: int = 0
    already_cached: int = 0
    not_stored: int = 0
    store_s: float = 0.0
    t_first: float = field(default_factory=time.perf_counter)


class LoadJob:
    """One step's loads: the leased units, which layers are in place, what failed.

    Its copies are issued a few layers at a time (`issue`, the engine's): a
    layer's event exists once that layer is issued; everything that waits
    for a layer issues it (and the ones just after) first."""

    def __init__(self, items: list[LoadItem], positions: dict[str, int], backend: Any,
                 issue: Callable[[LoadJob, int], None], ahead: int, layerwise: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.by_request: dict[str, list[LoadItem]] = defaultdict(list)
        for it in items:
            self.by_request[it.req_id].append(it)
        self.jobs: list[tuple[LoadItem, Any]] = []  # (item, its lease)
        self.failed: set[int] = set()  # block ids the caller must recompute
        self.reported: set[int] = set()  # ... of them, those the caller reported at submit
        self.broken: set[int] = set()  # job indices whose copy failed (written by the copies)
        self.sources: dict[int, Any] = {}  # job index -> decoded payload (compressed entries)
        self.batches: dict[int, tuple[list[int], Any]] = {}  # group -> (job index of each entry, its copy batch)
        self.events: list[Any] = []  # per forward position, once issued (None: no event of its own)
        self.layerwise = layerwise  # an event per layer (else one after the last: nobody waits per layer)
        self.copy_error: BaseException | None = None  # the first copy of the job that failed (written by the copies)
        self.layers = 0  # forward positions to issue (0: nothing leased, nothing to copy)
        self._positions = positions  # layer name -> forward position
        self._backend = backend
        self._issue = issue  # (job, through position) -> issues the job's copies up to it, and the other jobs'
        self._ahead = ahead  # layers issued past the one waited for
        self.seconds = 0.0  # from submit to completion
        self.loaded: dict[str, int] = {}  # request -> tokens loaded, once complete

    def wait_layer(self, name: str) -> None:
        """The compute goes on only once this layer's loads are in place (the
        host blocks on the CPU; on a GPU the compute stream waits). The
        layers after it are issued first (the engine's load_issue_ahead)."""
        idx = self._positions.get(name)
        if idx is None or idx >= self.layers:
            return
        if not self.layerwise:
            self.wait_all()
            return
        self._issue(self, idx + 1 + self._ahead)
        self._backend.compute_waits(self.events[idx])

    def issue_all(self) -> None:
        """Every layer's copies issued (what is waited for as a whole, or polled)."""
        if len(self.events) < self.layers:
            self._issue(self, self.layers)

    def wait_all(self) -> None:
        """The compute goes on only once every layer is in place (a forward
        that cannot wait layer by layer, e.g. a whole CUDA graph)."""
        self.issue_all()
        if self.events:
            self._backend.compute_waits(self.events[-1])

    def done(self) -> bool:
        """Whether every copy has run (what is left is issued first: a job
        nobody waits for, an asynchronous load, completes by being polled)."""
        self.issue_all()
        return not self.events or self.events[-1].query()

    def synchronize(self) -> None:
        """The host waits until every copy of the job has run."""
        self.issue_all()
        if self.events:
            self.events[-1].synchronize()


class TransferEngine:
    """Loads and stores units for one worker (one TP rank)."""

    def __init__(self, store: Store, layouts: KVLayout | Sequence[KVLayout], tp_rank: int, *,
                 digest_file: str = "", on_commit: Callable[[bytes, bytes, int], None] | None = None,
                 layer_order: Sequence[str] | None = None, lossy_ok: bool = False, deferred: bool = False,
                 skip_load_layers: str = "", layout_groups: Sequence[int] | None = None, backend: Any = None,
                 load_issue_ahead: int | None = None):
        """`layouts`: one per KV-cache group, in the caller's group order, or
        several per group (one per layer shape) with `layout_groups` giving
        each layout's KV-cache group (the index into an item's `groups`);
        `on_commit(key, namespace, tokens)`: told of each chunk committed (the
        tier chain's write-through); `layer_order`: every layer name in forward
        order (default: group by group); `lossy_ok`: lossy chunks may be
        loaded (else never); `deferred` (tests): CPU copies run only when
        something waits for them; `skip_load_layers` (tests only: proves
        that a test would catch a layer left unloaded): a regex of layer
        names whose loads are not copied; `backend` (tests): the streams'
        backend (the tests' DeviceModel), else the device's; `load_issue_ahead`:
        layers whose load copies are issued ahead of the one the forward waits
        for (default LOAD_ISSUE_AHEAD; at least the whole forward: every
        layer issued by submit_load, as before)."""
        self.cache = store
        self.on_commit = on_commit
        # a request whose stores must not commit (another TP rank's load of it failed: rank_failures.py)
        self.veto: Callable[[str], bool] | None = None
        self.layouts = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        self._layout_groups = list(layout_groups) if layout_groups is not None else list(range(len(self.layouts)))
        self._num_groups = len(set(self._layout_groups))
        if (len(self._layout_groups) != len(self.layouts)
                or set(self._layout_groups) != set(range(self._num_groups))):
            raise ValueError(f"layout_groups {self._layout_groups} must give each of the {len(self.layouts)} "
                             "layouts a KV-cache group, every group from 0 on having one")
        # NOTE: a recurrent-state group ("state" layout) holds one block per unit, whatever the block size
        attention = [lay for lay in self.layouts if lay.kind != "state"] or self.layouts
        self.layout = layout = attention[0]
        if len({lay.block_size for lay in attention}) != 1:
            raise ValueError("every KV-cache group must have the same block size")
        where = {name: (g, li) for g, lay in enumerate(self.layouts) for li, name in enumerate(lay.names)}
        order = list(layer_order) if layer_order is not None else list(where)
        if sorted(order) != sorted(where):
            raise ValueError("layer_order must name every layer of the groups once")
        self._order = [where[name] for name in order]  # forward position -> (group, layer in group)
        self._position = {name: i for i, name in enumerate(order)}
        self._skip_load = set()
        if skip_load_layers:
            import re

            self._skip_load = {where[n] for n in order if re.search(skip_load_layers, n)}
            log.warning("shmkv: %s=%r: loads leave %d layers unfilled", SKIP_LOAD_LAYERS,
                        skip_load_layers, len(self._skip_load))
        self.rank = tp_rank
        self.counters: Counter[str] = Counter()
        self.tallies: dict[str, RequestTally] = defaultdict(RequestTally)
        self.digest_file = digest_file
        self.lossy_ok = lossy_ok
        self.on_gpu = layout.on_gpu
        self.backend = backend if backend is not None else backend_for(layout.device, deferred=deferred)
        self._tracks = getattr(self.backend, "tracks_blocks", False)  # name the blocks each copy touches
        self._store_stream = self.backend.stream("store")
        self._load_stream = self.backend.stream("load")
        self._stores: list[StoreJob] = []  # issued, not yet committed or aborted (issue order)
        self._loads: list[LoadJob] = []  # issued, leases not yet released
        self.load_issue_ahead = LOAD_ISSUE_AHEAD if load_issue_ahead is None else load_issue_ahead
        if self.load_issue_ahead < 0:
            raise ValueError(f"load_issue_ahead must be 0 or more, not {self.load_issue_ahead}")

    # ------------------------------------------------------------ loads --
    def submit_load(self, items: list[LoadItem], *, layerwise: bool = True) -> LoadJob:
        """Lease the units, plan their copies and issue the first layers'.
        `layerwise=False`: nothing will wait for a single layer (an
        asynchronous load, a forward that waits for all): one event after
        the last layer instead of one per layer."""
        job = LoadJob(items, self._position, self.backend, self._issue_through, self.load_issue_ahead, layerwise)
        for req_id, its in job.by_request.items():
            try:
                leases = self.cache.acquire_prefix([it.keys[self.rank] for it in its], count_lookup=False)
            except Exception:
                log.exception("shmkv: lookup for loading request %s failed; it is recomputed", req_id)
                self.counters["load_errors"] += 1
                leases = []
            for i, it in enumerate(its):
                if i < len(leases):
                    job.jobs.append((it, leases[i]))
                else:
                    job.failed.update(it.block_ids)
                    self.counters["load_missing_units"] += 1
        self._loads.append(job)  # completed by poll_loads (at once when nothing is leased)
        if not job.jobs:
            return job
        job.layers = len(self._order)
        self._decode_compressed(job)
        # NOTE: the blocks being filled may still be read by compute issued before, and by the
        # gathers of pending stores (vLLM freed a request's blocks and gave them to this load,
        # perhaps in no list the scheduler half sees: a request parked for an asynchronous load).
        # The copies issued later (layer by layer, as the forward goes) are behind these waits
        # on the same stream
        self._load_stream.after_compute()
        self.counters["loads_after_stores"] += self._order_after_stores(
            self._load_stream, {b for it, _ in job.jobs for b in it.block_ids})
        try:
            self._load_stream.run(lambda s: self._prepare_batches(job, s))
        except Exception:
            log.exception("shmkv: preparing a load failed; its units are recomputed")
            self.counters["load_errors"] += 1
            job.broken.update(range(len(job.jobs)))
        self._issue_layers(job, self.load_issue_ahead)
        return job

    def issue_loads_through(self, name: str) -> None:
        """The forward reached layer `name` without a job to wait for (only
        asynchronous loads in flight): their copies are issued as far as a
        waiting job's would be."""
        pos = self._position.get(name)
        if pos is not None and self._loads and not self.backend.capturing():
            self._issue_through(None, pos + 1 + self.load_issue_ahead)

    def _issue_through(self, first: LoadJob | None, upto: int) -> None:
        """Every pending job's copies issued up to forward position `upto`,
        `first`'s before the others' (the one the forward waits for)."""
        if first is not None:
            self._issue_layers(first, upto)
        for job in self._loads:
            if job is not first:
                self._issue_layers(job, upto)

    def _issue_layers(self, job: LoadJob, upto: int) -> None:
        """Issue `job`'s copies of the forward positions it has not issued, up
        to `upto` (at most its last): one call per layer (every unit of the
        batch), each followed by that layer's event (the last layer's alone,
        if not layerwise). A copy's failure is the job's (never carried to
        another job's event)."""
        for pos in range(len(job.events), min(upto, job.layers)):
            g, layer = self._order[pos]
            try:
                touches, label = (), ""
                if self._tracks:
                    lay = self.layouts[g]
                    ids = [b for it, _ in job.jobs for b in self._tensor_blocks(lay, it.groups[self._layout_groups[g]])]
                    touches, label = [(lay.layers[layer], ids, "w")], f"load {lay.names[layer]}"
                self._load_stream.run(lambda s, g=g, layer=layer: self._copy_of_job(job, g, layer, s), touches,
                                      label)
            except Exception:
                log.exception("shmkv: issuing a load failed; its units are recomputed")
                self.counters["load_errors"] += 1
                job.broken.update(range(len(job.jobs)))
            job.events.append(self._load_stream.record() if job.layerwise or pos == job.layers - 1 else None)

    def _copy_of_job(self, job: LoadJob, group: int, layer: int, stream: Any) -> None:
        """A layer's copy, its failure kept by its job (a CUDA launch error on
        the host, a CPU copy on the copy thread): the job's units are
        recomputed once its copies have run."""
        try:
            self._load_layer(job, group, layer, stream)
        except Exception as e:
            if job.copy_error is None:
                job.copy_error = e

    def _prepare_batches(self, job: LoadJob, stream: Any) -> None:
        """Each group's copies of every unit, as one batch per group (on a GPU
        checked and uploaded once): every layer is then one call per group. A
        unit whose copy cannot be planned is broken (recomputed), the others go on."""
        per_group: dict[int, list] = defaultdict(list)
        for j, (it, lease) in enumerate(job.jobs):
            if j in job.broken:
                continue
            try:
                plan = self._copy_plan(it.groups)
            except Exception:
                log.exception("shmkv: loading a chunk of request %s failed; it is recomputed", it.req_id)
                job.broken.add(j)
                self.counters["load_errors"] += 1
                continue
            for g, _, index, options in plan:
                per_group[g].append((j, (index, job.sources.get(j, lease), options)))
        for g, entries in per_group.items():
            job.batches[g] = ([j for j, _ in entries], self.layouts[g].copier.batch([e for _, e in entries], stream))

    def _decode_compressed(self, job: LoadJob) -> None:
        """Decode the compressed entries of the batch (POST /compress) straight
        into host buffers the copies read from; a damaged one is recomputed."""
        for j, (it, lease) in enumerate(job.jobs):
            if not lease.compressed:
                continue
            try:
                got = decode_into(lease.view(), it.keys[self.rank], lambda n, _ns: self._host_buffer(n),
                                  lossy_ok=self.lossy_ok)
            except DamagedChunk as e:
                log.warning("shmkv: a compressed chunk of request %s is damaged (%s); it is recomputed", it.req_id, e)
                job.broken.add(j)
                self.counters["load_damaged"] += 1
                continue
            assert got is not None  # _host_buffer always gives one
            job.sources[j] = self._as_source(got[0])
            self.counters["load_decoded"] += 1

    def _host_buffer(self, nbytes: int) -> Any:
        """Where a decoded unit lies until its copies have run: on a GPU
        page-locked (torch's caching host allocator: a block reused, not a
        cudaHostAlloc per unit), which the copy kernels read through unified
        addressing; decoded into directly, no copy in between."""
        if self.on_gpu:
            import torch

            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        return bytearray(nbytes)

    def _as_source(self, buf: Any) -> Any:
        """What the copy backends take as a unit's payload."""
        if self.on_gpu:
            import torch

            return torch.from_numpy(buf)
        return buf

    def _load_layer(self, job: LoadJob, group: int, layer: int, stream: Any) -> None:
        """One layer of every unit of the batch (on the load stream): one call."""
        batch = job.batches.get(group)
        if batch is not None and (group, layer) not in self._skip_load:
            batch[1].copy_layer(layer, stream)

    def _complete_load(self, job: LoadJob) -> set[int]:
        """Its copies have run: release the leases; the blocks that failed."""
        error = job.copy_error or next((ev.error for ev in job.events if ev is not None and ev.error is not None),
                                       None)
        if error is not None:
            log.error("shmkv: a load copy failed (%s); its units are recomputed", error)
            self.counters["load_errors"] += 1
            job.broken.update(range(len(job.jobs)))
        for units, batch in job.batches.values():
            for k in batch.broken:  # a unit's copy failed (the others went on)
                if units[k] not in job.broken:
                    job.broken.add(units[k])
                    self.counters["load_errors"] += 1
            batch.release(self._load_stream.native)
        bs = self.layout.block_size
        loaded: dict[str, int] = defaultdict(int)
        for j, (it, lease) in enumerate(job.jobs):
            ok = j not in job.broken
            if ok and self.digest_file:
                self._digest_load(it)
            if not lease.release():  # reclaimed meanwhile: the bytes may be wrong
                self.counters["load_stale"] += 1
                ok = False
            if ok:
                loaded[it.req_id] += max((len(w.block_ids) for lay, w in self._windows(it.groups)
                                          if lay.kind != "state"), default=0) * bs
            else:
                job.failed.update(it.block_ids)
        job.seconds = time.perf_counter() - job.t0
        job.loaded = {r: loaded[r] for r in job.by_request}
        self.counters["loaded_tokens"] += sum(loaded.values())
        job.jobs, job.sources, job.batches = [], {}, {}
        return job.failed

    def load(self, items: list[LoadItem]) -> tuple[set[int], dict[str, tuple[int, float]]]:
        """Load now (submit, wait, complete): (block ids that failed, per
        request (tokens loaded, seconds))."""
        job = self.submit_load(items)
        job.synchronize()
        self.poll_loads()
        return job.failed, {r: (job.loaded.get(r, 0), job.seconds) for r in job.by_request}

    def poll_loads(self) -> list[tuple[LoadJob, set[int]]]:
        """Complete the load jobs whose copies have run (each job on its own:
        their layers are issued interleaved, so one job done says nothing of
        one issued before it)."""
        out, still = [], []
        for job in self._loads:
            if job.done():
                out.append((job, self._complete_load(job)))
            else:
                still.append(job)
        self._loads = still
        return out

    def _windows(self, groups: Sequence[GroupWindow]) -> list[tuple[KVLayout, GroupWindow]]:
        """Each layout with its KV-cache group's window of a unit."""
        if len(groups) != self._num_groups:
            raise InvalidArgumentError(f"a unit of {len(groups)} KV-cache group windows for an engine of "
                                       f"{self._num_groups} groups")
        return [(lay, groups[g]) for lay, g in zip(self.layouts, self._layout_groups)]

    def _sections(self, groups: Sequence[GroupWindow]) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each layout's section of a unit's payload."""
        out, off = [], 0
        for lay, w in self._windows(groups):
            n = lay.payload_bytes(w.payload_blocks * lay.block_size)
            out.append((off, n))
            off += n
        return out

    def _copy_plan(self, groups: Sequence[GroupWindow]) -> list[tuple[int, KVLayout, Any, dict[str, Any]]]:
        """Every group's copy of a unit: computed once per unit, then used for every layer."""
        return list(self._group_copies(groups))

    def _group_copies(self, groups: Sequence[GroupWindow]) -> Iterator[tuple[int, KVLayout, Any, dict[str, Any]]]:
        """(layout index, layout, index, copy options) of each layout a unit's
        copy touches, its block ids checked against the cache
        (InvalidArgumentError naming the group and block) before it is yielded."""
        import numpy as np

        sections = self._sections(groups)
        for g, (lay, w) in enumerate(self._windows(groups)):
            if not w.block_ids:
                continue  # nothing of this group is needed (outside its sliding window)
            ids = np.asarray(w.block_ids, dtype=np.int64)
            bad = ids[(ids < 0) | (ids >= lay.geometry.num_blocks)]
            if bad.size:
                raise InvalidArgumentError(f"KV-cache group {self._layout_groups[g]}: block id {int(bad[0])} is "
                                           f"outside the {lay.geometry.num_blocks} blocks of the cache")
            if lay.token_mode:
                yield g, lay, self._window_slots(lay, w), {"part": sections[g]}
            else:
                yield g, lay, ids, {"payload_first": w.payload_first, "payload_blocks": w.payload_blocks,
                                    "part": sections[g]}

    @staticmethod
    def _tensor_blocks(lay: KVLayout, w: GroupWindow) -> list[int]:
        """The blocks of `lay`'s tensors (their first dim) a unit's window covers (an order checker's view)."""
        per = max(1, lay.block_size // lay.geometry.block_size) if lay.token_mode else 1
        return [b * per + j for b in w.block_ids for j in range(per)]

    @staticmethod
    def _window_slots(lay: KVLayout, w: GroupWindow):
        """Token payloads: the slot of every token of the section; -1 outside the window."""
        import numpy as np

        bs = lay.block_size
        slots = np.full(w.payload_blocks * bs, -1, dtype=np.int64)
        inside = lay.slots_for_blocks(list(w.block_ids), len(w.block_ids) * bs)
        slots[w.payload_first * bs:w.payload_first * bs + len(inside)] = inside
        return slots

    # ----------------------------------------------------------- stores --
    def submit_store(self, items: Iterable[StoreItem]) -> None:
        """Reserve each unit's room and issue its gather after the compute
        issued so far; poll() commits it once its copies have run. One event
        marks the end of each request's run of units (a GPU records an
        event per request of the step, not per unit): its units commit
        together."""
        ordered = False
        run: list[StoreJob] = []  # the current request's units, waiting for their event
        for it in items:
            if run and run[0].item.req_id != it.req_id:
                self._end_store_run(run)
            t0 = time.perf_counter()
            tally = self.tallies[it.req_id]
            try:
                nbytes = sum(n for _, n in self._sections(it.groups))
                ns = it.namespaces[self.rank] if it.namespaces else None
                r = self.cache.reserve(it.keys[self.rank], nbytes, namespace=ns, tokens=it.tokens)
            except Exception:
                log.exception("shmkv: storing a chunk of request %s failed; continuing without it", it.req_id)
                self.counters["store_errors"] += 1
                tally.not_stored += 1
                continue
            if isinstance(r, PutResult):
                if r in (PutResult.EXISTS, PutResult.BUSY):
                    tally.already_cached += 1
                else:
                    tally.not_stored += 1
                self.counters[f"store_{r.name.lower()}"] += 1
                continue
            if not ordered:
                # NOTE: the gathers must see the KV the forward pass just wrote
                self._store_stream.after_compute()
                ordered = True
            job = StoreJob(it, r, ns, t0, blocks=frozenset(b for w in it.groups for b in w.block_ids))
            try:
                # one copy per group, each checked as it is issued
                for g, lay, index, options in self._group_copies(it.groups):
                    touches, label = (), ""
                    if self._tracks:
                        ids = self._tensor_blocks(lay, it.groups[self._layout_groups[g]])
                        touches, label = [(t, ids, "r") for t in lay.layers], f"store gather of {it.req_id}"
                    op = self._store_stream.run(lambda s, lay=lay, index=index, o=options, r=r:
                                                lay.gather(index, r, s, **o), touches, label)
                    if op is not None:
                        job.ops.append(op)
            except Exception:
                log.exception("shmkv: storing a chunk of request %s failed; continuing without it", it.req_id)
                job.failed = True
            # NOTE: a failed issue waits for the event too: the room is given back only
            # once every copy issued before has run (an earlier group's may be queued)
            run.append(job)
            self._stores.append(job)
        if run:
            self._end_store_run(run)

    def _end_store_run(self, run: list[StoreJob]) -> None:
        """One event after a request's run of units, shared by them."""
        ev = self._store_stream.record()
        for job in run:
            job.event = ev
        run.clear()

    def poll_stores(self) -> list[StoreJob]:
        """Commit (or abort) the stores whose copies have run; those stores."""
        still, done = [], []
        for job in self._stores:
            if job.event.query():
                self._complete_store(job)
                done.append(job)
            else:
                still.append(job)
        self._stores = still
        return done

    def _complete_store(self, job: StoreJob) -> None:
        it, r = job.item, job.reservation
        tally = self.tallies[it.req_id]
        job.seconds = time.perf_counter() - job.t0
        tally.store_s += job.seconds
        error = job.event.error
        if not job.doomed and self.veto is not None and self.veto(it.req_id):
            job.doomed = "a TP rank's load of this request failed: its KV of that step is wrong on every rank"
            self.counters["store_vetoed_rank_load_failed"] += 1
        if job.failed or job.doomed or error is not None:
            if error is not None:
                log.error("shmkv: storing a chunk of request %s failed (%s); continuing without it", it.req_id,
                          error)
            elif job.doomed:
                log.debug("shmkv: a chunk of request %s is not stored: %s", it.req_id, job.doomed)
            r.abort()
            self.counters["store_doomed" if job.doomed and error is None and not job.failed else "store_errors"] += 1
            tally.not_stored += 1
            return
        if self.digest_file:
            self._digest_store(it, r)
        if r.commit() is not PutResult.OK:
            self.counters["store_stale"] += 1
            tally.not_stored += 1
            return
        if self.on_commit is not None and job.namespace is not None:
            self.on_commit(r.key, job.namespace, it.tokens)
        tally.stored_units += 1
        tally.stored_tokens += it.tokens
        self.counters["stored_units"] += 1
        self.counters["stored_tokens"] += it.tokens

    def store(self, items: Iterable[StoreItem]) -> None:
        """Store now (submit, wait, commit)."""
        self.submit_store(items)
        self.wait_stores()

    def wait_stores(self) -> None:
        """Block until every pending store is committed or aborted."""
        for job in self._stores:
            job.event.synchronize()
        self.poll_stores()

    def order_compute_after_stores(self, req_ids: Iterable[str] | None = None) -> int:
        """The compute goes on only after the pending stores (of `req_ids`, or
        all) have read their blocks: on a GPU the compute stream waits on the
        device, on the CPU the host waits. How many waits."""
        want = None if req_ids is None else set(req_ids)
        return self.order_compute_after(j for j in self._stores if want is None or j.item.req_id in want)

    def _order_after_stores(self, stream: Any, block_ids: set[int]) -> int:
        """`stream`'s next copies run only after the pending stores reading
        any of `block_ids` have read them. How many waits (a request's stores
        of a step share one)."""
        n, seen = 0, set()
        for job in self.stores_on_blocks(block_ids):
            if id(job.event) not in seen and not job.event.query():
                seen.add(id(job.event))
                stream.wait(job.event)
                n += 1
        return n

    def pending_stores(self) -> list[StoreJob]:
        return list(self._stores)

    def stores_on_blocks(self, block_ids: set[int] | frozenset[int]) -> list[StoreJob]:
        """The pending stores whose gathers read any of `block_ids`."""
        return [job for job in self._stores if not job.blocks.isdisjoint(block_ids)]

    def order_compute_after(self, jobs: Iterable[StoreJob]) -> int:
        """The compute (and the loads issued after it) go on only after these
        stores have read their blocks. How many waits (a request's stores of a
        step share one)."""
        n, seen = 0, set()
        for job in jobs:
            if id(job.event) not in seen and not job.event.query():
                seen.add(id(job.event))
                self.backend.compute_waits(job.event)
                n += 1
        return n

    def doom(self, jobs: Iterable[StoreJob], why: str) -> int:
        """These stores' blocks were (or may have been) rewritten before their
        gathers ran: they are aborted once their copies have run, never
        committed. How many."""
        n = 0
        for job in jobs:
            if not job.doomed:
                job.doomed = why
                n += 1
                discard = getattr(self._store_stream, "discard", None)
                if discard is not None and job.ops:
                    discard(job.ops)  # a checking backend: the race cannot corrupt what nobody keeps
        return n

    def pending_requests(self) -> set[str]:
        return {job.item.req_id for job in self._stores}

    def finish(self, req_id: str) -> RequestTally | None:
        return self.tallies.pop(req_id, None)

    def wait_loads(self) -> None:
        """Block until every issued load's copies have run (poll_loads then completes them)."""
        for job in self._loads:
            job.synchronize()

    def shutdown(self) -> None:
        """Finish every copy in flight, commit and release, stop the streams."""
        self.wait_loads()
        self.poll_loads()
        self.wait_stores()
        self._store_stream.close()
        self._load_stream.close()

    # ------------------------------------------------------------ debug --
    # Lines "store KEY GROUP DIGEST" (a group's section as stored) and "load
    # KEY GROUP FIRST N TOTAL DIGEST" (the paged cache's bytes of the blocks a
    # load filled, re-gathered once its copies have run): a load with FIRST 0
    # and N == TOTAL must digest like the stored section.
    def _digest_load(self, it: LoadItem) -> None:
        import torch

        lines = []
        for g, (lay, w) in enumerate(self._windows(it.groups)):
            n = len(w.block_ids)
            if not n:
                continue
            tokens = n * lay.block_size
            buf = torch.empty(lay.payload_bytes(tokens), dtype=torch.uint8, pin_memory=self.on_gpu)
            index = lay.slots_for_blocks(list(w.block_ids), tokens) if lay.token_mode else list(w.block_ids)
            # NOTE: on the load stream, after the load's own copies; waited for here (debug only)
            self._load_stream.run(lambda s, lay=lay, index=index, buf=buf: lay.gather(index, buf, s))
            self._load_stream.record().synchronize()
            lines.append(f"load {it.keys[self.rank].hex()} {g} {w.payload_first} {n} {w.payload_blocks} "
                         f"{xxhash.xxh3_128_hexdigest(buf.numpy())}\n")
        with open(self.digest_file, "a") as f:
            f.writelines(lines)

    def _digest_store(self, it: StoreItem, r: Reservation) -> None:
        """The sections as committed (their copies have run)."""
        mv = r.view()
        with open(self.digest_file, "a") as f:
            for g, (off, n) in enumerate(self._sections(it.groups)):
                f.write(f"store {r.key.hex()} {g} {xxhash.xxh3_128_hexdigest(mv[off:off + n])}\n")
