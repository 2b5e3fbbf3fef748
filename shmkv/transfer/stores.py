"""The transfer engine's stores (shmkv.transfer.engine holds the façade):
units from one worker's paged KV cache into the shared segment.

submit_store reserves each unit's room, issues its gather on the store stream
after the compute, and records an event after each request's units (one per
request of the step, not per unit). poll_stores commits a store whose event
has completed, or aborts it if any of its copies failed: never while a copy
issued for it may still run (a freed extent is never written). Until then its
source blocks must stay untouched: `pending_requests` says whose, and
`order_compute_after_stores` / `order_compute_after` order the compute after
them, or `doom` aborts them (the caller's choice once vLLM gives their blocks
out again: preemption, sliding windows); a request another TP rank failed to
load is vetoed (never committed).

Invariant: a unit that cannot be stored (store full, another process writing
it, a failed copy) is skipped and counted; nothing raises into the caller
for a unit. The attributes StoreSide uses are the façade's
(TransferEngine.__init__)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from shmkv.store import PutResult, Reservation
from shmkv.transfer.items import StoreItem

log = logging.getLogger("shmkv.transfer")


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


class StoreSide:
    """The engine's store direction (module doc)."""

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

    def _digest_store(self, it: StoreItem, r: Reservation) -> None:
        """The sections as committed (their copies have run)."""
        mv = r.view()
        with open(self.digest_file, "a") as f:
            for g, (off, n) in enumerate(self._sections(it.groups)):
                f.write(f"store {r.key.hex()} {g} {xxhash.xxh3_128_hexdigest(mv[off:off + n])}\n")
