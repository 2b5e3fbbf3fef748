"""The connector's worker half (one vLLM worker process, one TP rank): a thin
adapter from vLLM's call order to the transfer engine (shmkv.transfer),
which does every copy and its bookkeeping, the same on a GPU and on the CPU.

Per step, in vLLM's order: bind (the scheduler half's ShmKVMetadata),
handle_preemptions (the compute waits for pending stores of preempted
requests: vLLM reuses their blocks this step), start_load (issue the loads;
each attention layer waits only for its own, or for all before a forward
that cannot wait layer by layer), wait_for_save (issue the stores, after the
forward), get_finished (the delayed-free protocol), load_errors. Invariant:
vLLM hears of every failed block of a synchronous load in the step whose
forward read it (the host waits for the load stream once, after the forward
was issued and before the first of wait_for_save / get_finished /
load_errors), and nothing computed over it is stored. With
speculative decoding vLLM calls get_finished before that step's
wait_for_save (defer_kv_connector_finalize): a request whose stores were
bound but not yet issued is never reported finished.

Asynchronous loads (engines of several KV-cache groups, where vLLM cannot
take a failed load back as block ids): the forward never waits for them;
get_finished reports each such request once in finished_recving when its
copies have run, and take_failed_recving those that failed (vLLM
recomputes them), never their block ids.

Delayed frees. The scheduler half returns delay_free_blocks=True from
request_finished exactly for the requests whose store items it shipped
(ShmKVMetadata.stores); this half reports each of those, once, in
finished_sending as soon as vLLM says it finished and none of its stores is
still copying, and never any other request (vLLM asserts on an id it did not
delay). That holds even when the KV caches could not be registered (no
engine: nothing is pending, the ids are reported at once).

Off: a worker that cannot copy this engine's KV cache (a KV-cache group of
a kind shmkv cannot restore, KV caches it cannot register) still answers
vLLM's protocol exactly: every delayed request is reported finished at
once, every load it is asked for fails (vLLM recomputes). The connector
sends its off_reason (and `sections`) to the scheduler half in vLLM's start
handshake, which turns the connector off for the whole engine before the
first request.

Nothing here raises into vLLM: a unit that cannot be loaded is reported
through `load_errors` and vLLM recomputes it; one that cannot be stored is
skipped; each such path has a counter (the engine's).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from shmkv.activity import ActivitySummary
from shmkv.errors import InvalidArgumentError
from shmkv.integration.vllm.kv_registration import first_attention_tensor, layouts_of, say_registered
from shmkv.integration.vllm.planner import ALL_BLOCKS
from shmkv.integration.vllm.rank_failures import RankFailures
from shmkv.store import Store
from shmkv.testing import switches as test_switches
from shmkv.tiers import TierChain, open_tiers
from shmkv.transfer import LoadJob, TransferEngine

log = logging.getLogger("shmkv.connector")


def _new_transfer_stats() -> dict[str, Any]:
    return {"counters": {}, "observations": {}}


def _count(stats: dict[str, Any], **counts: int) -> None:
    for k, n in counts.items():
        if n:
            stats["counters"][k] = stats["counters"].get(k, 0) + n


def _render(c: dict, seconds: float) -> str:
    return (f"shmkv: last {seconds:.0f} s: loaded {c.get('loaded_tokens', 0)} tokens in "
            f"{c.get('load_ms', 0):.0f} ms ({c.get('load_failed_blocks', 0)} blocks left to vLLM), stored "
            f"{c.get('stored_tokens', 0)} tokens in {c.get('stored_chunks', 0)} chunks in "
            f"{c.get('store_ms', 0):.0f} ms ({c.get('already_cached', 0)} already cached, "
            f"{c.get('not_stored', 0)} not stored)")


def _requests_touching(job: LoadJob, blocks: set[int]) -> set[str]:
    """The requests of a load job with an item on any of `blocks`."""
    if not blocks:
        return set()
    return {r for r, items in job.by_request.items() if any(b in blocks for it in items for b in it.block_ids)}


class WorkerSide:
    """The connector's worker half: it builds the copy layouts when vLLM
    registers its KV caches, then drives the transfer engine in vLLM's call
    order. Free of vLLM imports: it sees vLLM's tensors and the scheduler
    half's ShmKVMetadata only."""

    def __init__(self, cfg: Any, store: Store | None, groups: Sequence[Any], tp_rank: int, block_size: int, *,
                 stores: bool = True, deferred: bool = False, off_reason: str | None = None,
                 backend: Any = None, writes_before_hooks: bool = False) -> None:
        """`stores`: this rank stores what the scheduler half ships (False:
        another rank stores the same bytes, as with MLA; this one only loads
        and reports its requests finished at once). `off_reason`: this
        worker cannot serve the engine (decided before vLLM built the KV
        cache; `store` may then be None): it only answers the protocol.
        `writes_before_hooks`: vLLM's runner may write a step's new blocks
        (zeroing, copy-on-write, Mamba's pre-copy) before the connector's
        first call of the step (Model Runner V2; V1 calls handle_preemptions
        first)."""
        self.cfg = cfg
        self.store = store
        self.groups = list(groups)  # engine_inputs.KVGroup per KV-cache group
        self.tp_rank = tp_rank
        self.stores = stores
        self.block_size = block_size  # of vLLM's block tables
        self.worker: TransferEngine | None = None
        self.chain: TierChain | None = None  # with remote_write_through: committed chunks are queued for remote
        self.off_reason = off_reason  # the KV caches cannot be copied: every load is recomputed
        self.sections = ""  # the payload's per-shape sections, where a group's layers differ in shape
        self.activity = ActivitySummary(log, cfg.log_summary_s, _render)
        self._deferred = deferred  # tests: CPU copies run only when waited for
        self._backend = backend  # tests: the streams' backend (tests/support/device_model.py)
        self._switches = test_switches()
        self._transfer = _new_transfer_stats()  # since vLLM last asked (get_kv_connector_stats)
        self._load_errors: set[int] = set()  # blocks vLLM must recompute
        self._storing: set[str] = set()  # requests with store items: vLLM delays their frees
        self._unsubmitted: set[str] = set()  # bound this step, not yet given to the transfer engine
        self._finished_waiting: set[str] = set()  # finished, stores still copying
        self._loading: tuple[Any, LoadJob] | None = None  # this step's metadata and loads
        self._load_failed_reqs: set[str] = set()  # a synchronous load of theirs failed: nothing more stored
        self._settled: LoadJob | None = None  # the last synchronous load job whose outcome is known
        self.read_without_hooks: tuple[str, ...] = ()  # layers an op reads with no wait_for_layer_load
        self._async_jobs: dict[int, set[str]] = {}  # id(load job) -> its asynchronous requests
        self._recv_done: set[str] = set()  # asynchronous loads complete (finished_recving)
        self._recv_failed: set[str] = set()  # ... of them, those that failed (failed_recving)
        self._summaries: dict[int, Any] = {}  # id(load job) -> its step's per-request summaries
        self._registered = False  # the segment is registered with CUDA for this worker
        self.writes_before_hooks = writes_before_hooks
        self.suspended = False  # sleep mode: between unregister_kv_caches and restore_kv_caches
        self.stopped: str | None = None  # why this rank copies nothing more (stop): no resume
        self.peers: RankFailures | None = None  # TP >= 2: the requests any rank's load failed for (share_failures)
        self.adapters_held: Callable[[], dict[int, str]] | None = None  # LoRA: lora_int_id -> digest (adapters.py)
        self._adapters_unchecked: set[str] = set()  # loaded before vLLM read their adapter: checked when they store

    def share_failures(self, engine: str) -> None:
        """TP >= 2: this rank marks the requests its synchronous loads failed
        for, and stores nothing of a request any rank marked (rank_failures.py)."""
        try:
            self.peers = RankFailures(engine)
        except OSError as e:
            # NOTE: without it a rank could store over another rank's failed load: this rank stores nothing
            self.stop(f"the TP ranks' load-failure file could not be opened ({e})")
            return
        if self.worker is not None:
            self.worker.veto = self.peers.marked

    def _mark_failed(self, req_ids: set[str]) -> None:
        """Requests computed (this step) over blocks a load of this rank did not fill: no rank stores them."""
        new = req_ids - self._load_failed_reqs
        if not new:
            return
        self._load_failed_reqs |= new
        if self.peers is not None:
            self.peers.mark(new)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.off_reason is not None:
            return
        first = first_attention_tensor(kv_caches, self.groups)
        kind = "cpu" if first.device.type == "cpu" else "hnd"
        try:
            layouts, layout_groups, self.sections = layouts_of(kv_caches, self.groups, self.block_size)
            if first.device.type == "cuda":
                from shmkv.transfer import gpu

                for lay in layouts:
                    lay.copier.engines(store=self.cfg.cuda_store_copy, load=self.cfg.cuda_load_copy)
                seconds = gpu.register_segment(self.store)  # pinned, mapped: copies address the segment directly
                self._registered = True
                log.info("shmkv: registered the %.1f GiB arena with CUDA in %.2f s",
                         self.store.arena_bytes / 2**30, seconds)
            if self.cfg.remote_write_through:  # the only tier move a worker makes
                self.chain = open_tiers(self.cfg, self.store, kv_element_size_bytes=first.element_size(), disk=False)
            self.worker = TransferEngine(self.store, layouts, self.tp_rank, digest_file=self.cfg.debug_digest_file,
                                         on_commit=self.chain.write_through if self.chain else None,
                                         layer_order=list(kv_caches),
                                         lossy_ok=bool(self.cfg.lossy_form), deferred=self._deferred,
                                         skip_load_layers=self._switches.skip_load_layers,
                                         layout_groups=layout_groups, backend=self._backend)
        except Exception as e:
            # NOTE: never stop vLLM's start for the cache: serve without it, saying why
            self.off_reason = str(e) if isinstance(e, InvalidArgumentError) else f"{type(e).__name__}: {e}"
            # NOTE: the scheduler half says so at WARNING for the engine (vLLM's start handshake)
            log.info("shmkv: TP rank %d cannot copy this engine's KV cache (%s)", self.tp_rank, self.off_reason,
                     exc_info=not isinstance(e, InvalidArgumentError))
            if self.chain is not None:
                self.chain.close(flush_timeout_s=0)
                self.chain = None
            self._unregister()
            return
        say_registered(layouts, len(kv_caches), len(self.groups), kind, self.worker.on_gpu, self.sections)
        if not self.stores:
            log.info("shmkv: TP rank %d only loads: rank 0 stores the latent (MLA) KV every rank holds", self.tp_rank)

    def state_layers(self) -> set[str]:
        """The layers of linear-attention state groups."""
        return {n for g in self.groups if g.state for n in g.layer_names}

    def set_read_without_hooks(self, names: Sequence[str]) -> None:
        """Layers read by ops that call no wait_for_layer_load: a step with
        synchronous loads then waits for every layer before the forward."""
        self.read_without_hooks = tuple(names)
        if names:
            log.info("shmkv: %d KV-cache layers are read by ops without vLLM's per-layer load hook (%s%s): a step "
                     "that loads makes its forward wait for every layer first", len(names), ", ".join(names[:3]),
                     ", ..." if len(names) > 3 else "")

    def bind(self, meta: Any) -> None:
        """A step's metadata arrives (first, before any load or store)."""
        if getattr(meta, "failed_blocks", None):
            self._load_errors |= meta.failed_blocks
        failed = getattr(meta, "failed_loads", None)
        if failed:
            self._recv_done |= failed
            self._recv_failed |= failed
        # NOTE: a rank that does not store still reports these ids: vLLM frees a
        # delayed request once every rank has reported it
        bound = {it.req_id for it in getattr(meta, "stores", ())}
        self._storing |= bound
        self._unsubmitted = bound if self.stores else set()
        self._order_reused_blocks(meta)  # V2 calls handle_preemptions first, V1 bind later: either is early enough

    def handle_preemptions(self, meta: Any) -> None:
        """vLLM's first call of a step in V1 (before it zeroes or copies new
        blocks), the first of V2's pre_forward (after): _order_reused_blocks."""
        self._order_reused_blocks(meta)

    def _order_reused_blocks(self, meta: Any) -> None:
        """vLLM freed blocks (a preempted request's, those a sliding window or
        a recurrent state left behind) and gave them out again this step: a
        pending store still reading one must read it before the step writes
        it. The compute (and the loads after it) wait for such stores; where
        the runner may already have written the block (Model Runner V2's
        zeroing, copy-on-write and Mamba pre-copy run before this call), the
        store is aborted instead: its bytes cannot be trusted. Once per step."""
        if self.worker is None or getattr(meta, "_shmkv_reuse_ordered", False):
            return
        try:
            meta._shmkv_reuse_ordered = True  # the same object reaches handle_preemptions and bind
        except AttributeError:  # a frozen test double: each call then orders again (idempotent)
            pass
        reused = getattr(meta, "reused_blocks", None)
        if reused is None:  # an older scheduler half: what it says are the preempted requests
            ids = getattr(meta, "preempted", None) or set()
            reused_jobs, prewritten_jobs = [j for j in self.worker.pending_stores() if j.item.req_id in ids], []
        else:
            pre = getattr(meta, "prewritten_blocks", set()) if self.writes_before_hooks else set()
            reused_jobs = self._stores_on(reused)
            prewritten_jobs = self._stores_on(pre) if pre else []
        doomed = self.worker.doom(prewritten_jobs, "its blocks were given out again and rewritten before vLLM's "
                                                   "first connector call of the step")
        waited = self.worker.order_compute_after([j for j in reused_jobs if not j.doomed])
        self.worker.counters["reused_block_store_waits"] += waited
        if doomed or waited:
            log.debug("shmkv: blocks of pending stores given out again: %d ordered before the step, %d aborted",
                      waited, doomed)

    def _stores_on(self, blocks: set[int]) -> list:
        """The pending stores reading any of `blocks` (ALL_BLOCKS: every pending store)."""
        assert self.worker is not None
        return self.worker.pending_stores() if ALL_BLOCKS in blocks else self.worker.stores_on_blocks(blocks)

    def start_load(self, meta: Any, *, whole_forward: bool = False) -> None:
        """Issue this step's loads. `whole_forward`: the forward cannot wait
        layer by layer (a full CUDA graph replays no Python): it waits for
        every layer now."""
        async_reqs = set(getattr(meta, "async_loads", ()))
        if self.worker is None and self.off_reason is not None:
            self._refuse_loads(meta, async_reqs)
            return
        if self.worker is None:
            return
        loads = list(getattr(meta, "loads", None) or ())
        other = self._check_adapters(meta, async_reqs)
        if other and loads:
            self._refuse_loads(meta, async_reqs, only=other)
            loads = [it for it in loads if it.req_id not in other]
        if not loads:
            return
        if self._asleep("loads", len(loads)):
            self._refuse_loads(meta, async_reqs)
            return
        if self._switches.evict_before_load and self._switches.evict_rank in (None, self.tp_rank):
            # a test's: what another engine's eviction can do (to every rank, or to one)
            for it in loads:
                self.store.delete(it.keys[self.tp_rank])
        later = [it for it in loads if it.req_id in async_reqs]
        if later:
            # NOTE: vLLM computes these requests only once get_finished reports them
            job = self.worker.submit_load(later, layerwise=False)
            self._summaries[id(job)] = meta.summaries
            self._async_jobs[id(job)] = {it.req_id for it in later}
        now = [it for it in loads if it.req_id not in async_reqs]
        if not now:
            return
        whole = whole_forward or self.read_without_hooks
        job = self.worker.submit_load(now, layerwise=not whole)
        self._summaries[id(job)] = meta.summaries
        # NOTE: units that failed already (evicted since the lookup, a damaged compressed chunk)
        # are vLLM's to recompute in this step's output, before it samples from their blocks
        job.reported = job.failed | {b for j in job.broken for b in job.jobs[j][0].block_ids}
        self._load_errors |= job.reported
        if job.reported:  # before this rank's forward starts, so before any rank passes its first all-reduce
            self._mark_failed(_requests_touching(job, job.reported))
        if whole:
            job.wait_all()
            self.worker.counters["whole_forward_loads"] += 1
        self._loading = meta, job

    def _refuse_loads(self, meta: Any, async_reqs: set[str], only: set[str] | None = None) -> None:
        """This step's loads (`only` those of these requests) are not run:
        vLLM recomputes their blocks (never runs on blocks nobody filled);
        asynchronous ones are reported failed."""
        refused = set()
        for it in getattr(meta, "loads", ()):
            if only is not None and it.req_id not in only:
                continue
            if it.req_id in async_reqs:
                self._recv_failed.add(it.req_id)
            else:
                self._load_errors.update(it.block_ids)
                refused.add(it.req_id)
        self._recv_done |= async_reqs if only is None else async_reqs & only
        self._mark_failed(refused)  # other ranks may have loaded them: this rank computes over unfilled blocks

    def _check_adapters(self, meta: Any, async_reqs: set[str]) -> set[str]:
        """This step's requests whose keys name a LoRA adapter other than the
        one this rank holds under their id (evicted and read again from
        changed files, or changed while vLLM read them; adapters.py): their
        loads are refused, and no rank stores anything of them from now on.
        A request vLLM has not put in a batch yet (an asynchronous load: its
        adapter is read when it first computes, from the files as they are
        then, and again for a load_inplace request) is checked at its next
        step here (the ones that store), and if vLLM read other files by
        then, nothing of it is stored (counted, logged: its output used KV of
        the adapter as it was when it arrived)."""
        expected = getattr(meta, "adapters", None)
        if not expected:
            return set()
        try:
            held = self.adapters_held() if self.adapters_held is not None else {}
        except Exception:  # noqa: BLE001 - unknown: none of them is served from or into the cache
            log.exception("shmkv: reading which LoRA adapters vLLM holds failed")
            held = {}
        rereads = getattr(meta, "adapter_rereads", set())
        other = set()
        for req_id, (aid, digest) in expected.items():
            now = held.get(aid)
            if req_id in async_reqs and (now is None or req_id in rereads):
                self._adapters_unchecked.add(req_id)  # vLLM reads the adapter when the request first computes
            elif now != digest:
                other.add(req_id)
        assert self.worker is not None  # start_load calls this only for a registered worker
        late = (other & self._adapters_unchecked) - self._load_failed_reqs
        if late:
            self.worker.counters["adapter_changed_after_async_load"] += len(late)
            log.warning("shmkv: TP rank %d: requests %s loaded KV of their LoRA adapter's files as they were when "
                        "they arrived, and vLLM read other files for them since (rewritten meanwhile): their "
                        "output mixes both versions, and nothing of them is stored", self.tp_rank, sorted(late))
        self._adapters_unchecked -= {r for r in expected if r not in async_reqs}  # checked against what it holds
        new = other - self._load_failed_reqs
        if new:
            self.worker.counters["adapter_mismatch"] += len(new)
            log.info("shmkv: TP rank %d holds other LoRA adapter tensors than the keys of requests %s name (the "
                     "adapter was read again from changed files): they are neither loaded nor stored",
                     self.tp_rank, sorted(new))
        self._mark_failed(other)
        return other

    def wait_layer(self, layer_name: str) -> None:
        """The forward reaches `layer_name`: this step's synchronous loads of
        it are waited for; the copies of the layers just after (asynchronous
        loads' too) are issued."""
        if self._loading is not None:
            self._loading[1].wait_layer(layer_name)
        elif self._async_jobs and self.worker is not None:
            self.worker.issue_loads_through(layer_name)

    def finish_forward(self) -> None:
        """Model Runner V2, after the target's forward: what runs next (an
        EAGLE/MTP or draft-model proposer, perhaps a FULL CUDA graph with no
        per-layer hook) reads the drafter's layers: every load is waited for."""
        if self._loading is not None:
            self._loading[1].wait_all()

    def _poll(self) -> None:
        """Commit finished stores, release finished loads (never blocks)."""
        if self.worker is None:
            return
        stored = self.worker.poll_stores()
        if stored:
            self._transfer["observations"].setdefault("store_seconds", []).extend(j.seconds for j in stored)
        for job, failed in self.worker.poll_loads():
            async_reqs = self._async_jobs.pop(id(job), None)
            if async_reqs is None:
                self._load_errors |= failed - job.reported  # those reported at submit, once
            else:
                self._recv_done |= async_reqs
                self._recv_failed |= _requests_touching(job, failed)
            self._report_load(job, failed)

    def _report_load(self, job: LoadJob, failed: set[int]) -> None:
        summaries = self._summaries.pop(id(job), {})
        loaded = sum(job.loaded.values())
        self.activity.add(loaded_tokens=loaded, load_ms=job.seconds * 1e3, load_failed_blocks=len(failed))
        _count(self._transfer, loaded_tokens=loaded, load_failed_blocks=len(failed))
        self._transfer["observations"].setdefault("load_seconds", []).append(job.seconds)
        for req_id, tokens in job.loaded.items():
            s = summaries.get(req_id)
            log.debug("shmkv: request %s: prompt %d tokens, hit %d (vLLM prefix cache %d), loaded %d in %.1f ms%s",
                      req_id, s.prompt_tokens if s else -1, (s.local_tokens + s.hit_tokens) if s else -1,
                      s.local_tokens if s else -1, tokens, job.seconds * 1e3,
                      f", {len(failed)} blocks to recompute" if failed else "")

    def wait_for_save(self, meta: Any) -> None:
        """After the forward was issued: learn how this step's synchronous
        loads ended (_settle_loading: the one wait for copies), issue this
        step's stores (they complete asynchronously) except those of requests
        a load failed, and take what has completed."""
        self._settle_loading()
        self._loading = None
        self._unsubmitted = set()
        if self.worker is None:
            return
        stores = list(getattr(meta, "stores", None) or ()) if self.stores else []
        if (self._load_failed_reqs or self.peers is not None) and stores:
            # NOTE: those requests were computed over blocks a load (of any TP rank) did not fill: vLLM
            # recomputes them (the invalid blocks of the step that read them); what was computed over them,
            # in that step or in one vLLM scheduled before it heard (asynchronous scheduling), is not stored
            peers = self.peers
            kept = [it for it in stores if it.req_id not in self._load_failed_reqs
                    and not (peers is not None and peers.marked(it.req_id))]
            if len(kept) < len(stores):
                self.worker.counters["stores_dropped_after_failed_load"] += len(stores) - len(kept)
                log.info("shmkv: %d chunks of requests %s not stored: computed over a load that failed (this "
                         "rank's or another TP rank's)", len(stores) - len(kept),
                         sorted({it.req_id for it in stores} - {it.req_id for it in kept}))
                stores = kept
        if stores and not self._asleep("stores", len(stores)):
            self.worker.submit_store(stores)
        before = self.worker.counters["stored_tokens"]
        self._poll()
        _count(self._transfer, stored_tokens=self.worker.counters["stored_tokens"] - before)

    def _settle_loading(self) -> None:
        """This step's synchronous loads, ended before vLLM hears anything of
        the step. Some failures show only once the copies ran (a failed copy,
        a lease reclaimed meanwhile): vLLM must find their blocks in this
        step's invalid blocks, or it emits the token it sampled from them
        before it hears, and no store of those requests may be committed. So
        the host waits for the load stream here, once per step that loads,
        after the forward was issued (the forward itself waited for each
        layer: the copies are near their end); on the CPU they have run."""
        if self._loading is None or self.worker is None or self._loading[1] is self._settled:
            return
        job = self._settled = self._loading[1]
        if not job.done():
            t0 = time.perf_counter()
            job.synchronize()
            self.worker.counters["load_outcome_waits"] += 1
            self._transfer["observations"].setdefault("load_outcome_wait_seconds", []).append(
                time.perf_counter() - t0)
        self._poll()
        self._mark_failed(_requests_touching(job, job.failed))

    def take_transfer_stats(self) -> dict[str, Any] | None:
        """What this worker moved since the last call ({"counters", "observations"}), or None."""
        out, self._transfer = self._transfer, _new_transfer_stats()
        return out if out["counters"] or any(out["observations"].values()) else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving): the delayed requests whose
        stores have all completed, each once; the requests whose
        asynchronous loads have completed (or failed), each once."""
        if self._loading is not None:
            # NOTE: V1 with speculative decoding asks here, after the target's forward and before
            # the drafter's (which may replay a FULL CUDA graph, with no per-layer hook): the
            # drafter's layers are loaded by then (V2: finish_forward)
            self._loading[1].wait_all()
            self._settle_loading()
        if self.worker is not None:
            before = self.worker.counters["stored_tokens"]
            self._poll()
            _count(self._transfer, stored_tokens=self.worker.counters["stored_tokens"] - before)
            for req_id in finished_req_ids:
                self._log_stores(req_id)
        self._finished_waiting |= set(finished_req_ids) & self._storing
        self._load_failed_reqs -= set(finished_req_ids)
        self._adapters_unchecked -= set(finished_req_ids)
        if self.peers is not None:
            self.peers.forget(finished_req_ids)
        pending = self.worker.pending_requests() if self.worker is not None else set()
        # NOTE: with speculative decoding vLLM asks before this step's wait_for_save:
        # stores bound this step but not yet issued are pending too
        pending |= self._unsubmitted if self.worker is not None else set()
        done = {r for r in self._finished_waiting if r not in pending}
        self._finished_waiting -= done
        self._storing -= done
        recv, self._recv_done = self._recv_done, set()
        return (done or None), (recv or None)

    def take_failed_recving(self) -> set[str]:
        """The asynchronous loads that failed since the last call (each also
        in get_finished's finished_recving): vLLM recomputes those requests."""
        out, self._recv_failed = self._recv_failed, set()
        return out

    def _log_stores(self, req_id: str) -> None:
        t = self.worker.finish(req_id) if self.worker is not None else None
        if t and (t.stored_units or t.already_cached or t.not_stored):
            log.debug("shmkv: request %s: stored %d tokens in %d chunks (%.1f ms); %d already cached, %d not "
                      "stored", req_id, t.stored_tokens, t.stored_units, t.store_s * 1e3, t.already_cached,
                      t.not_stored)
            self.activity.add(stored_tokens=t.stored_tokens, stored_chunks=t.stored_units,
                              store_ms=t.store_s * 1e3, already_cached=t.already_cached, not_stored=t.not_stored)

    def load_errors(self) -> set[int]:
        """Blocks vLLM must recompute (and forget them)."""
        self._settle_loading()
        self._poll()
        out, self._load_errors = self._load_errors, set()
        return out

    def suspend(self) -> None:
        """Sleep mode (vLLM 0.33+ unregister_kv_caches): vLLM frees or remaps
        the KV cache next, and assumes no transfer reads or writes it. Every
        issued load and store is waited for and completed here (the stores
        committed, their requests reported finished by get_finished as
        usual); until resume() no copy is issued: a step's loads are
        recomputed and its stores dropped, counted and logged (vLLM steps
        only after restore_kv_caches)."""
        if self.worker is not None and not self.suspended:
            n = len(self.worker.pending_stores())
            self.worker.wait_loads()
            self.worker.wait_stores()
            self._loading = None
            self._poll()
            log.info("shmkv: sleep mode: %d pending stores drained; no copy touches the KV cache until wake-up", n)
        self.suspended = True

    def resume(self) -> None:
        """Wake-up (vLLM 0.33+ restore_kv_caches)."""
        self.suspended = self.stopped is not None

    def stop(self, reason: str) -> None:
        """This rank copies nothing more for this engine (its weights can no
        longer be vouched for): pending copies complete, later loads are
        recomputed by vLLM and stores dropped, counted (copies_refused_stopped)."""
        if self.stopped is None:
            self.suspend()
            self.stopped = reason
            self.suspended = True
            log.warning("shmkv: TP rank %d copies nothing more for this engine: %s", self.tp_rank, reason)

    def _asleep(self, what: str, n: int) -> bool:
        """Whether copies must not run now (sleep mode, or stopped); counted and logged."""
        if not self.suspended or self.worker is None:
            return False
        if self.stopped is not None:
            self.worker.counters["copies_refused_stopped"] += n
            return True
        self.worker.counters["copies_refused_asleep"] += n
        log.warning("shmkv: %d %s asked for while vLLM's KV cache is unregistered (sleep mode, before "
                    "restore_kv_caches): not run", n, what)
        return True

    def _unregister(self) -> None:
        if self._registered:
            from shmkv.transfer import gpu

            self._registered = False
            gpu.unregister_segment(self.store)

    def shutdown(self) -> None:
        self._loading = None
        if self.worker is not None:
            self.worker.shutdown()  # every copy done: nothing reads the pinned pages any more
            self._poll()
        if self.chain is not None:
            self.chain.close(flush_timeout_s=10)  # write-through: the queued remote writes get 10 s
            self.chain = None
        self._unregister()
