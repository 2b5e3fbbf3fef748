"""The scheduler half's step (scheduler.py): the metadata shipped to the
workers with each step (ShmKVMetadata): the loads of the requests admitted
with a hit, the stores of what this step computes, the adapters they read,
and the blocks vLLM gave out this step (a worker orders its pending stores
on them before their reuse).

Invariant: what is shipped is what the workers act on and report as
finished (request_finished rests on the same set); a step whose loads cannot
be planned reports their blocks as failed (vLLM recomputes them), one whose
stores cannot be planned stores nothing. The attributes used here are
SchedulerSide's."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from shmkv.integration.vllm.metadata import RequestSummary, ShmKVMetadata
from shmkv.integration.vllm.planner import ALL_BLOCKS, NULL_BLOCK, RequestPlan
from shmkv.transfer.items import StoreItem

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

log = logging.getLogger("shmkv.connector")


class StepMetadata:
    """What each step ships to the workers (module doc), mixed into SchedulerSide."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ShmKVMetadata:
        meta = ShmKVMetadata()
        self._read_weights()  # a step without lookups: running requests store nothing of changed weights
        self._weights_read = False  # the next step reads them again
        meta.check_weights = self.weights.asked
        try:
            self._plan_loads(meta, scheduler_output)
        finally:
            self._pending_loads.clear()
        try:
            self._build(scheduler_output, meta)
        except Exception:
            log.exception("shmkv: planning the stores of this step failed; they are skipped")
            meta.stores = []
        # NOTE: the delay decision (request_finished) rests on what is shipped, the
        # same predicate the workers use to report finished_sending
        storing = {it.req_id for it in meta.stores}
        self._shipped_stores |= storing
        for req_id in storing:
            plan = self._plans.get(req_id)
            if plan is not None and plan.adapter is not None:
                meta.adapters[req_id] = plan.adapter
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        try:
            meta.reused_blocks, meta.prewritten_blocks = self._blocks_given_out(scheduler_output)
        except Exception:
            # NOTE: without them a worker cannot order its stores: it treats every pending one as reused
            self.counters["block_plan_errors"] += 1
            log.exception("shmkv: reading this step's new blocks failed; pending stores are ordered before it")
            meta.reused_blocks, meta.prewritten_blocks = {ALL_BLOCKS}, {ALL_BLOCKS}
        return meta

    def _blocks_given_out(self, so: SchedulerOutput) -> tuple[set[int], set[int]]:
        """(every block vLLM gave out this step, those its runner may write
        before the connector's first call): new blocks of new and resumed
        requests past their own prefix-cache hit (V2 sends a resumed request
        as a new one), new blocks of running ones, copy-on-write targets,
        blocks to zero; of these, the zeroed and copy-on-write ones and any
        new block of a recurrent-state group (Mamba's pre-copy) are prewritten."""
        bs = self.block_size
        state = [g.state for g in self._groups]
        given, prewritten = set(), set()

        def add(groups, skip: int = 0) -> None:
            for g, ids in enumerate(groups or ()):
                new = {b for b in ids[skip:] if b != NULL_BLOCK}
                given.update(new)
                if g < len(state) and state[g]:
                    prewritten.update(new)

        for new in so.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            add(new.block_ids, plan.local_tokens // bs if plan is not None else 0)
        for ids in so.scheduled_cached_reqs.new_block_ids:
            add(ids)
        copies = {c.dst_block_id for c in getattr(so, "kv_cache_block_copies", None) or ()}
        zeroed = set(getattr(so, "new_block_ids_to_zero", None) or ())
        return given | copies | zeroed, prewritten | copies | zeroed

    def _plan_loads(self, meta: ShmKVMetadata, so: SchedulerOutput) -> None:
        """Load items of the requests admitted with a hit. A request whose loads
        cannot be planned has its promised blocks reported as load errors (an
        asynchronous load: the request as a failed one), so vLLM recomputes
        them (never runs on blocks nobody filled)."""
        planner = self._planner(None)  # units carry their own keys: any planner of this geometry
        bs = self.block_size
        for req_id, plan in self._pending_loads.items():
            try:
                plan.scheduled_tokens = so.num_scheduled_tokens.get(req_id, 0)
                meta.loads.extend(planner.load_items(plan))
            except Exception:
                self.counters["lookup_errors"] += 1
                log.exception("shmkv: planning the load of request %s failed; vLLM recomputes it", req_id)
                if plan.load_async:
                    meta.failed_loads.add(req_id)
                else:
                    lo, hi = plan.local_tokens // bs, (plan.local_tokens + plan.hit_tokens) // bs
                    meta.failed_blocks.update(b for ids in plan.block_ids for b in ids[lo:hi] if b != NULL_BLOCK)
                continue
            if plan.adapter is not None:
                meta.adapters[req_id] = plan.adapter
                if getattr(getattr(plan.request, "lora_request", None), "load_inplace", False):
                    meta.adapter_rereads.add(req_id)
            if plan.load_async:
                meta.async_loads.add(req_id)
            meta.summaries[req_id] = RequestSummary(req_id, plan.prompt_len, plan.local_tokens, plan.hit_tokens)

    def _load_async(self, tokens: int) -> bool:
        """Whether a load of `tokens` goes asynchronously (see always_async_loads)."""
        if self.always_async_loads:
            return True
        limit = self.cfg.sync_load_max
        return bool(limit) and self._chunk_bytes * tokens / self.cfg.chunk_size > limit

    def _build(self, so: SchedulerOutput, meta: ShmKVMetadata) -> None:
        planner = self._planner(None)
        # Admitted now: vLLM asks again only if it preempts the request, and
        # that new admission is counted and logged like a first one.
        for new in so.scheduled_new_reqs:
            self._asked.discard(new.req_id)
        for req_id in so.scheduled_cached_reqs.resumed_req_ids:
            self._asked.discard(req_id)
        if not self.stores_enabled or self.weights.fields() is None:
            return  # weights not known (or being checked): KV computed now is not stored
        for new in so.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:  # never seen by get_num_new_matched_tokens: its salt is unknown
                continue
            plan.block_ids = [list(ids) for ids in new.block_ids]
            done = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
            meta.stores.extend(self._announce(plan, planner.store_items(plan, done)))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            plan = self._plans.get(req_id)
            if plan is None or plan.next_store >= len(plan.units):
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                plan.block_ids = [list(ids) for ids in new_ids] if new_ids else [[] for _ in self._groups]
            elif new_ids:
                for mine, ids in zip(plan.block_ids, new_ids):
                    mine.extend(ids)
            done = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(req_id, 0)
            meta.stores.extend(self._announce(plan, planner.store_items(plan, done)))
        block_state = getattr(so, "kv_connector_block_state", None)
        for req_id, offers in (getattr(block_state, "boundary_state_offloads", None) or {}).items():
            plan = self._plans.get(req_id)
            if plan is not None:  # the recurrent states vLLM kept this step at a block boundary
                meta.stores.extend(self._announce(plan, planner.store_state_items(plan, offers)))

    def _announce(self, plan: RequestPlan, items: list[StoreItem]) -> list[StoreItem]:
        """Tell the KV events (if on) which units these store items write,
        with the blocks each group holds of them."""
        if self.events is not None and items and plan.request is not None:
            shipped = {it.keys for it in items}
            planner = plan.planner
            try:
                kinds = (False, True) if any(planner.states) else (False,)
                units = [u.state_unit() if state else u for u in plan.units for state in kinds]
                self.events.stores_planned(plan.request, [(u, planner.group_blocks(u)) for u in units
                                                          if tuple(u.keys) in shipped])
            except Exception:  # events are for routers: never a reason to skip a store
                self.counters["event_errors"] += 1
                log.exception("shmkv: KV events of request %s could not be prepared", plan.req_id)
        return items
