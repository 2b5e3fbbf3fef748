"""shmkv as a secondary tier of vLLM's native offloading (OffloadingConnector
with TieringOffloadingSpec): `{"type": "shmkv"}` in `secondary_tiers`
(registered by the package's vLLM plugin, shmkv.integration.vllm.register).

vLLM's own worker copies GPU <-> its per-engine pinned CPU region (the
primary tier); this tier moves whole chunks between that region and the
host's shared segment, so every engine of the host shares one byte-capped,
LRU-evicted CPU tier, with shmkv's disk and remote tiers behind it.

What it owns and its invariants:
  * keys never mix configurations: a chunk's key is xxh3-128 of the tier's
    namespace root (model, KV dtype and layout, block and chunk geometry,
    the groups' layer names, bytes per block and chunk, the parallel layout
    unless vLLM says the bytes are parallelism-agnostic) and vLLM's
    OffloadKey (block hash and group);
  * the scheduler never blocks: lookup answers from the shared table (HIT
    only for committed chunks; RETRY while another process is writing the
    chunk, for at most WRITING_RETRY_S, and while a chunk found on disk or
    remote is promoted in the background); submit_store / submit_load only
    queue the copies on a CPU copy stream of the transfer engine
    (shmkv.transfer.streams), one Store.write_chunks / read_chunks call per
    job, and get_finished_jobs reports them once their event is set;
  * every lease and reservation is given back on every path (a failed copy,
    drain, shutdown; a killed process's are reclaimed by the survivors);
  * with KV events on, every chunk this engine reported stored is reported
    removed once it has left the segment (evicted, deleted, cleared by
    anyone): a sweep of at most SWEEP_KEYS_PER_STEP keys per step runs
    whenever the segment's removal counters moved.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xxhash
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.base import RequestOffloadingContext as _RequestContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from shmkv.config import io_threads, load_config
from shmkv.errors import ConfigError
from shmkv.integration.vllm.native_identity import NativeIdentity
from shmkv.integration.vllm.versions import check_vllm_version
from shmkv.store import Presence, PutResult, ReadResult, open_store
from shmkv.tiers import open_tiers
from shmkv.transfer.streams import CpuStream

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger("shmkv.native_tier")

FORMAT_TAG = b"shmkv-native-tier-1"  # part of every namespace root: a layout change gets new keys
MAX_FAILED_PROMOTIONS = 65536  # keys whose promotion failed, remembered so lookups answer MISS
MAX_COPY_THREADS = 4  # a job's chunks are split over this many copy threads (at most io_threads)
MIN_CHUNKS_PER_COPY_THREAD = 16
WRITING_RETRY_S = 1.0  # a chunk another process is writing: RETRY this long, then MISS (a frozen writer)
MAX_WRITING_TRACKED = 65536
SWEEP_KEYS_PER_STEP = 1024  # reported chunks checked per take_events() call while removals are pending

# The tier's own metrics (get_stats / build_metric_definitions), beside vLLM's
# kv_offload_tiering_* ones: counter name -> (shmkv counter, documentation).
METRIC_PREFIX = "vllm:kv_offload_shmkv_"
COUNTER_METRICS = {
    "lookups": "Chunk lookups answered by the shmkv tier.",
    "hits": "Chunk lookups the shmkv tier answered HIT (committed in the host's shared segment).",
    "retries_writing": "Chunk lookups answered RETRY because another process was writing the chunk.",
    "promotions": "Chunks found in shmkv's disk or remote tier and promoted into the shared segment.",
    "promotion_failures": "Promotions from shmkv's disk or remote tier that failed (the lookup then missed).",
    "stored": "Chunks this engine copied into the shared segment.",
    "already_held": "Chunks this engine offered that the segment already held, committed.",
    "not_stored": "Chunks the shared segment refused (full of pinned or leased chunks, lock timeout, or another "
                  "engine still writing the chunk: vLLM is told they were not stored, and may offer them again).",
    "loaded": "Chunks copied from the shared segment into this engine's CPU tier.",
    "weights_unknown": "Lookups answered MISS and jobs refused while the engine's weights were changing in memory "
                       "(or not known): the tier's keys name the weights the engine computes with.",
    "load_failed": "Chunks a load job could not copy (evicted meanwhile, another layout, reclaimed).",
    "removed": "Chunks reported removed from the host tier (KV events).",
}
GAUGE_METRICS = {
    "segment_used_bytes": "Bytes of chunks in the host's shared segment (all engines).",
    "segment_capacity_bytes": "Payload bytes the host's shared segment can hold.",
}


def namespace_root(offloading_config: Any, chunk_bytes: int,
                   identity: tuple[tuple[str, str], ...]) -> tuple[bytes, dict[str, Any]]:
    """The tier's namespace root (16 bytes) and the fields it covers, from
    vLLM's OffloadingConfig and the engine's identity (its configuration and
    weights, native_identity.py): only identical configurations share chunks."""
    c = offloading_config
    par = c.parallel
    fields: dict[str, Any] = {
        "model": c.model.name, "kv_dtype": c.model.dtype, "kv_cache_layout": c.kv_cache_layout,
        "canonical_layout": bool(c.canonical_layout), "replicated_layout": bool(c.replicated_layout),
        "tokens_per_hash": c.cache.tokens_per_hash, "blocks_per_chunk": c.cache.blocks_per_chunk,
        "groups": [(g.group_id, g.tokens_per_block, list(g.layer_names)) for g in c.groups],
        "worker_kv_bytes_per_block": c.worker_kv_bytes_per_block, "chunk_bytes": chunk_bytes,
    }
    if not par.is_parallelism_agnostic:
        fields["parallel"] = {"world_size": par.world_size, "tp": par.tp_size, "pp": par.pp_size,
                              "pcp": par.pcp_size, "dcp": par.dcp_size}
    fields.update(identity)
    blob = FORMAT_TAG + repr(sorted(fields.items())).encode()
    return xxhash.xxh3_128_digest(blob), fields


@dataclass
class _Job:
    job_id: int
    is_load: bool
    nkeys: int
    t0: float
    event: Any = None
    ok_keys: list | None = None  # filled by the copy: vLLM's keys of the chunks done
    ok_shm: list = field(default_factory=list)  # ... and their keys in the segment (a store's)
    failed: int = 0
    nbytes: int = 0


class ShmkvSecondaryTier(SecondaryTierManager):
    """The host-shared shmkv segment as one of vLLM's secondary tiers."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, locality: Any = None, **options: Any) -> None:
        check_vllm_version()
        super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                         backpressure_detector=backpressure_detector)
        try:
            self.cfg = load_config(dict(options))
        except ConfigError as e:
            raise ConfigError(f"secondary tier {{\"type\": \"{tier_type}\"}}: {e}") from e
        self.locality = Locality(str(locality).upper()) if locality else Locality.LOCAL  # this host's memory
        self.chunk_bytes = self.block_size_bytes
        self._primary = np.asarray(primary_kv_view).reshape(-1).view(np.uint8)
        config = offloading_spec.config
        self.identity = NativeIdentity(config)
        self._identity = self.identity.fields()
        self.root: bytes | None = None
        self.fields: dict[str, Any] = {}
        if self._identity is not None:
            self.root, self.fields = namespace_root(config, self.chunk_bytes, self._identity)
        self._config = config
        self.tokens_per_chunk = config.cache.blocks_per_chunk * config.groups[0].tokens_per_block
        self.store = open_store(self.cfg)
        max_payload = self.store.stats()["max_payload_bytes"]
        if self.chunk_bytes > max_payload:
            raise ConfigError(f"a chunk of the primary tier is {self.chunk_bytes} bytes, over the segment's "
                              f"max_payload_bytes {max_payload} (cache {self.cfg.cache_name}); lower "
                              "blocks_per_chunk or recreate the segment with a larger max_payload_bytes")
        self.chain = open_tiers(self.cfg, self.store, kv_element_size_bytes=_dtype_bytes(config.model.dtype),
                                max_chunk_bytes=self.chunk_bytes)  # every chunk of this tier is exactly that
        self._maintainer_role = None
        if self.cfg.maintainer:
            from shmkv.services.maintainer import MaintainerRole

            self._maintainer_role = MaintainerRole(self.cfg, self.chain)
            self._maintainer_role.start()
        self._stream = CpuStream("native-tier")
        self._copy_threads = min(MAX_COPY_THREADS, io_threads(self.cfg))
        self._copiers = ThreadPoolExecutor(max_workers=self._copy_threads - 1, thread_name_prefix="shmkv-native-copy") \
            if self._copy_threads > 1 else None
        self._jobs: dict[int, _Job] = {}
        self._events: list[OffloadingEvent] = []
        self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmkv-native-promote") \
            if self.chain.lower else None
        self._promoting: dict[bytes, Future] = {}
        self._failed_promotions: dict[bytes, None] = {}
        self._writing_since: dict[bytes, float] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_METRICS, 0)
        self._reported: dict[str, int] = dict.fromkeys(COUNTER_METRICS, 0)
        self._events_on = bool(config.enable_kv_cache_events)
        self._announced: dict[bytes, OffloadKey] = {}  # chunks reported stored and not yet removed
        self._removal_mark = self.store.removal_count()
        self._sweep: list[bytes] = []
        self._check_hashes()
        log.info("shmkv: native offloading tier ready (cache %s, namespace root %s: model %s, %s, %d-byte chunks, "
                 "weights %s%s)", self.cfg.cache_name, self.root.hex() if self.root else "(weights not known yet)",
                 config.model.name, config.model.dtype, self.chunk_bytes,
                 str(self.fields.get("weights", "?"))[:24], ", disk/remote behind it" if self.chain.lower else "")

    # ------------------------------------------------------------- keys --
    def key_of(self, key: OffloadKey, root: bytes | None = None) -> bytes:
        return xxhash.xxh3_128_digest((root or self.root or b"") + bytes(key))

    def _current_root(self) -> bytes | None:
        """The namespace root of the weights the engine computes with now;
        None while they are not known (a rank's weights changing in memory):
        nothing is then looked up, loaded or stored (native_identity.py)."""
        ident = self.identity.fields()
        if ident != self._identity:
            self._identity = ident
            if ident is None:
                self.root = None
                log.info("shmkv: the engine's weights may be changing in memory: the native tier answers MISS and "
                         "stores nothing until the workers fingerprinted them")
            else:
                self.root, self.fields = namespace_root(self._config, self.chunk_bytes, ident)
                log.info("shmkv: the native tier's namespace is now root %s (weights %s)", self.root.hex(),
                         dict(ident).get("weights_gen", "as started")[:16])
        return self.root

    def _check_hashes(self) -> None:
        """vLLM's default sha256 block hashes are the same in every process;
        the non-cryptographic ones are seeded per process without PYTHONHASHSEED."""
        try:
            from vllm.config import get_current_vllm_config

            algo = get_current_vllm_config().cache_config.prefix_caching_hash_algo
        except Exception:
            return
        if not str(algo).startswith("sha256") and not os.environ.get("PYTHONHASHSEED"):
            log.warning("shmkv: prefix_caching_hash_algo=%s without PYTHONHASHSEED: block hashes differ between "
                        "processes, so no other engine will find this engine's chunks (set PYTHONHASHSEED, the "
                        "same in every engine, or keep sha256)", algo)

    # ----------------------------------------------------------- lookup --
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.counters["lookups"] += 1
        root = self._current_root()
        if root is None:
            self.counters["weights_unknown"] += 1
            return LookupResult.MISS
        k = self.key_of(key, root)
        presence = self.store.presence([k])[0]
        if presence is Presence.READY:
            self.counters["hits"] += 1
            self._writing_since.pop(k, None)
            return LookupResult.HIT
        fut = self._promoting.get(k)
        if fut is not None:
            if not fut.done():
                return LookupResult.RETRY
            self._promoting.pop(k)
            if self.store.contains([k])[0]:
                self.counters["hits"] += 1
                return LookupResult.HIT
            self.counters["promotion_failures"] += 1
            self._remember_failed(k)
            return LookupResult.MISS
        if presence is Presence.WRITING:
            if self._writer_may_finish(k):
                self.counters["retries_writing"] += 1
                return LookupResult.RETRY
        else:
            self._writing_since.pop(k, None)  # a write that ended (aborted): the next writer gets its own window
        if self._promoter is None or k in self._failed_promotions:
            return LookupResult.MISS
        if not any(t.contains([k], [root])[0] for t in self.chain.lower):
            return LookupResult.MISS
        # NOTE: read and decode off the scheduler's thread; the next lookups answer RETRY until it is done
        self._promoting[k] = self._promoter.submit(self.chain.promote, [k], [root])
        self.counters["promotions"] += 1
        return LookupResult.RETRY

    def _writer_may_finish(self, k: bytes) -> bool:
        """Whether to wait for another process writing `k`: yes for
        WRITING_RETRY_S from the first time a lookup saw it writing."""
        now = time.monotonic()
        first = self._writing_since.setdefault(k, now)
        while len(self._writing_since) > MAX_WRITING_TRACKED:
            self._writing_since.pop(next(iter(self._writing_since)))
        return now - first < WRITING_RETRY_S

    def _remember_failed(self, k: bytes) -> None:
        self._failed_promotions[k] = None
        while len(self._failed_promotions) > MAX_FAILED_PROMOTIONS:
            self._failed_promotions.pop(next(iter(self._failed_promotions)))

    # ------------------------------------------------------------- jobs --
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job_metadata: TransferJob, *, is_load: bool) -> None:
        """Queue the job's copies on the copy stream; get_finished_jobs reports
        it once its event is set. While the weights are not known, the job
        fails whole (vLLM is told nothing was loaded or stored)."""
        root = self._current_root()
        offload_keys = list(job_metadata.keys)
        job = _Job(job_metadata.job_id, is_load, len(offload_keys), time.monotonic(), ok_keys=[])
        if root is None:
            self.counters["weights_unknown"] += 1
            job.failed = job.nkeys
            self._stream.run(lambda _: None)
        else:
            keys = [self.key_of(k, root) for k in offload_keys]
            ids = [int(i) for i in job_metadata.chunk_ids]
            if is_load:
                self._stream.run(lambda _: self._load_chunks(job, keys, ids, offload_keys))
            else:
                self._stream.run(lambda _: self._store_chunks(job, keys, ids, offload_keys, root))
        job.event = self._stream.record()
        self._jobs[job.job_id] = job

    def _store_chunks(self, job: _Job, keys: list[bytes], ids: list[int], offload_keys: list, root: bytes) -> None:
        """On the copy thread: primary-tier chunks into the shared tier (under the root of their submission)."""
        n = self.chunk_bytes
        results = self._in_parallel(lambda ks, cs: self.store.write_chunks(
            ks, self._primary, [c * n for c in cs], n, namespace=root, tokens=self.tokens_per_chunk), keys, ids)
        for r, k, ok in zip(results, keys, offload_keys):
            if r is PutResult.OK:
                self.counters["stored"] += 1
                job.ok_keys.append(ok)
                job.ok_shm.append(k)
                job.nbytes += n
                self.chain.write_through(k, root, self.tokens_per_chunk)
            elif r is PutResult.EXISTS:
                self.counters["already_held"] += 1
                job.ok_keys.append(ok)
                job.ok_shm.append(k)
            # NOTE: BUSY (another engine writing the chunk, or the table lock timed out) is not
            # stored: that write may still be aborted, and vLLM would count on a chunk that is not there
            else:
                self.counters["not_stored"] += 1
                job.failed += 1

    def _load_chunks(self, job: _Job, keys: list[bytes], ids: list[int], offload_keys: list) -> None:
        """On the copy thread: shared-tier chunks into the primary tier. A
        chunk of another size or re-encoded by /compress is not served here;
        one reclaimed during its copy (STALE) counts as failed: its bytes may
        be wrong, and vLLM frees the slot of a key it is not told loaded."""
        n = self.chunk_bytes
        results = self._in_parallel(lambda ks, cs: self.store.read_chunks(ks, self._primary, [c * n for c in cs], n),
                                    keys, ids)
        for r, ok in zip(results, offload_keys):
            if r is ReadResult.OK:
                self.counters["loaded"] += 1
                job.ok_keys.append(ok)
                job.nbytes += n
            else:
                self.counters["load_failed"] += 1
                job.failed += 1

    def _in_parallel(self, copy: Any, keys: list[bytes], ids: list[int]) -> list:
        """copy(keys, ids) over slices of the job, one per copy thread (the
        copies run without the GIL); the results in the keys' order."""
        parts = min(self._copy_threads, len(keys) // MIN_CHUNKS_PER_COPY_THREAD)
        if parts <= 1:
            return copy(keys, ids)
        step = -(-len(keys) // parts)
        futures = [self._copiers.submit(copy, keys[i:i + step], ids[i:i + step]) for i in range(step, len(keys), step)]
        out = list(copy(keys[:step], ids[:step]))
        for f in futures:
            out.extend(f.result())
        return out

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        for job_id, job in list(self._jobs.items()):
            if not job.event.query():
                continue
            del self._jobs[job_id]
            if job.event.error is not None:
                log.error("shmkv: a native-tier %s job failed: %s", "load" if job.is_load else "store",
                          job.event.error)
            ok = job.event.error is None and job.failed == 0 and len(job.ok_keys) == job.nkeys
            if not job.is_load and job.ok_keys and self._events_on:
                self._events.append(OffloadingEvent(keys=list(job.ok_keys), medium=Medium.CPU, removed=False,
                                                    locality=self.locality, ownership=self.tier_type))
                for k, ok in zip(job.ok_shm, job.ok_keys):
                    self._announced[k] = ok
            out.append(JobResult(job_id=job_id, success=ok,
                                 successful_keys=None if ok or not job.is_load else list(job.ok_keys),
                                 transfer_time=time.monotonic() - job.t0, transfer_bytes=job.nbytes))
        return out

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or any(not f.done() for f in self._promoting.values())

    def drain_jobs(self) -> None:
        for job in list(self._jobs.values()):
            job.event.synchronize()

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events_on:
            self._sweep_removed()
        out, self._events = self._events, []
        return out

    def _sweep_removed(self) -> None:
        """Report chunks this engine announced that have left the segment.
        A sweep over the announced keys starts whenever the segment's
        removal counters moved, and checks SWEEP_KEYS_PER_STEP keys per call."""
        if not self._sweep:
            if not self._announced:
                return
            now = self.store.removal_count()
            if now == self._removal_mark:
                return
            self._removal_mark = now
            self._sweep = list(self._announced)
        batch, self._sweep = self._sweep[:SWEEP_KEYS_PER_STEP], self._sweep[SWEEP_KEYS_PER_STEP:]
        present = self.store.presence(batch)
        gone = [self._announced.pop(k) for k, p in zip(batch, present) if p is Presence.ABSENT and k in self._announced]
        if gone:
            self.counters["removed"] += len(gone)
            self._events.append(OffloadingEvent(keys=gone, medium=Medium.CPU, removed=True, locality=self.locality,
                                                ownership=self.tier_type))

    # ---------------------------------------------------------- metrics --
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

        defs: dict[str, Any] = {METRIC_PREFIX + name: OffloadingCounterMetadata(documentation=doc)
                                for name, doc in COUNTER_METRICS.items()}
        defs.update({METRIC_PREFIX + name: OffloadingGaugeMetadata(documentation=doc)
                     for name, doc in GAUGE_METRICS.items()})
        return defs

    def get_stats(self) -> Any:
        """This tier's counters since the last call, and the segment's fill."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

        stats = OffloadingConnectorStats()
        for name, value in self.counters.items():
            delta = value - self._reported[name]
            if delta:
                stats.increase_counter(METRIC_PREFIX + name, delta)
                self._reported[name] = value
        st = self.store.stats()
        stats.set_gauge(METRIC_PREFIX + "segment_used_bytes", st["bytes_used"])
        stats.set_gauge(METRIC_PREFIX + "segment_capacity_bytes", st["arena_bytes"])
        return stats

    def on_new_request(self, req_context: ReqContext) -> _RequestContext:
        return _RequestContext()

    def shutdown(self) -> None:
        self.drain_jobs()
        self._stream.close()
        if self._copiers is not None:
            self._copiers.shutdown(wait=True)
        self._primary = None  # vLLM unmaps the primary region after this: no export of it may remain
        if self._promoter is not None:
            self._promoter.shutdown(wait=True)
        if self._maintainer_role is not None:
            self._maintainer_role.stop()
        self.chain.close(flush_timeout_s=10)
        self.store.close()
        self.identity.close()


def _dtype_bytes(name: str) -> int:
    try:
        import torch

        return torch.empty((), dtype=getattr(torch, str(name).replace("torch.", ""))).element_size()
    except Exception:
        return 2
