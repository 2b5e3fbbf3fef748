"""The transfer engine's loads (shmkv.transfer.engine holds the façade):
units from the shared segment into one worker's paged KV cache.

submit_load acquires the leases, plans and uploads the batch's copies once,
then issues the first few layers' copies (every unit of the batch, one call
per layer) on the load stream, each followed by an event, and returns: the
forward's launch does not wait for the host to issue every layer. The rest
are issued in forward order as the forward goes: LoadJob.wait_layer(name)
issues every job's copies up to load_issue_ahead layers past that layer (its
own job first), then makes the compute wait on that layer's event; wait_all,
done and synchronize issue all that is left. Compressed entries are decoded
into host buffers the copies read from. The leases are released once the
last event has completed (poll_loads), never by blocking the host.

Invariant: a unit that cannot be loaded (evicted since the lookup, lease gone
stale, damaged, a failed copy) reports its blocks as failed and is
recomputed; nothing raises into the caller for a unit, and every such path
has a counter. The attributes LoadSide uses are the façade's
(TransferEngine.__init__)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import xxhash

from shmkv.tiers.format import DamagedChunk, decode_into
from shmkv.transfer.items import LoadItem

log = logging.getLogger("shmkv.transfer")

# NOTE: layers whose load copies are in flight ahead of the layer the forward waits for: enough that
# the load stream never runs dry while the host launches a layer (CPU: while it computes one), few
# enough that start_load_kv returns after a handful of launches, not after every layer's
LOAD_ISSUE_AHEAD = 4


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


class LoadSide:
    """The engine's load direction (module doc)."""

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

    def wait_loads(self) -> None:
        """Block until every issued load's copies have run (poll_loads then completes them)."""
        for job in self._loads:
            job.synchronize()

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
