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
    only for committed chunks; RETRY while a chunk found on disk or remote is
    promoted in the background); submit_store / submit_load only queue the
    copies on a CPU copy stream of the transfer engine (shmkv.transfer.streams),
    and get_finished_jobs reports them once their event is set;
  * every lease and reservation is given back on every path (a failed copy,
    drain, shutdown; a killed process's are reclaimed by the survivors).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import xxhash
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, OffloadKey, ReqContext
from vllm.v1.kv_offload.base import RequestOffloadingContext as _RequestContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from shmkv.config import io_threads, load_config
from shmkv.disk import open_disk
from shmkv.errors import ConfigError
from shmkv.remote import open_remote
from shmkv.store import PutResult, open_store
from shmkv.tiers import TierChain
from shmkv.transfer.streams import CpuStream

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger("shmkv.native_tier")

FORMAT_TAG = b"shmkv-native-tier-1"  # part of every namespace root: a layout change gets new keys
MAX_FAILED_PROMOTIONS = 65536  # keys whose promotion failed, remembered so lookups answer MISS


def namespace_root(offloading_config: Any, chunk_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The tier's namespace root (16 bytes) and the fields it covers, from
    vLLM's OffloadingConfig: only identical configurations share chunks."""
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
    blob = FORMAT_TAG + repr(sorted(fields.items())).encode()
    return xxhash.xxh3_128_digest(blob), fields


@dataclass
class _Job:
    job_id: int
    is_load: bool
    nkeys: int
    t0: float
    event: Any = None
    ok_keys: list | None = None  # filled by the copy
    failed: int = 0
    nbytes: int = 0


class ShmkvSecondaryTier(SecondaryTierManager):
    """The host-shared shmkv segment as one of vLLM's secondary tiers."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, locality: Any = None, **options: Any) -> None:
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
        self.root, self.fields = namespace_root(config, self.chunk_bytes)
        self.tokens_per_chunk = config.cache.blocks_per_chunk * config.groups[0].tokens_per_block
        self.store = open_store(self.cfg)
        max_payload = self.store.stats()["max_payload_bytes"]
        if self.chunk_bytes > max_payload:
            raise ConfigError(f"a chunk of the primary tier is {self.chunk_bytes} bytes, over the segment's "
                              f"max_payload_bytes {max_payload} (cache {self.cfg.cache_name}); lower "
                              "blocks_per_chunk or recreate the segment with a larger max_payload_bytes")
        element = _dtype_bytes(config.model.dtype)
        disk = open_disk(self.cfg, store=self.store, element_size=self.cfg.disk_shuffle_bytes or element)
        remote = open_remote(self.cfg, store=self.store, disk=disk, element_size=self.cfg.disk_shuffle_bytes or element)
        self.remote = remote
        self.chain = TierChain(self.store, [disk, remote], threads=io_threads(self.cfg))
        self._maintainer_role = None
        if self.cfg.maintainer:
            from shmkv.maintainer import MaintainerRole

            self._maintainer_role = MaintainerRole(self.cfg, self.chain)
            self._maintainer_role.start()
        self._stream = CpuStream("native-tier")
        self._jobs: dict[int, _Job] = {}
        self._events: list[OffloadingEvent] = []
        self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmkv-native-promote") \
            if self.chain.lower else None
        self._promoting: dict[bytes, Future] = {}
        self._failed_promotions: dict[bytes, None] = {}
        self.counters: dict[str, int] = {"lookups": 0, "hits": 0, "promotions": 0, "stored": 0, "already_held": 0,
                                         "not_stored": 0, "loaded": 0, "load_missing": 0}
        self._check_hashes()
        log.info("shmkv: native offloading tier ready (cache %s, namespace root %s: model %s, %s, %d-byte chunks%s)",
                 self.cfg.cache_name, self.root.hex(), config.model.name, config.model.dtype, self.chunk_bytes,
                 ", disk/remote behind it" if self.chain.lower else "")

    # ------------------------------------------------------------- keys --
    def key_of(self, key: OffloadKey) -> bytes:
        return xxhash.xxh3_128_digest(self.root + bytes(key))

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
        k = self.key_of(key)
        self.counters["lookups"] += 1
        if self.store.contains([k])[0]:
            self.counters["hits"] += 1
            return LookupResult.HIT
        fut = self._promoting.get(k)
        if fut is not None:
            if not fut.done():
                return LookupResult.RETRY
            self._promoting.pop(k)
            if self.store.contains([k])[0]:
                self.counters["hits"] += 1
                return LookupResult.HIT
            self._remember_failed(k)
            return LookupResult.MISS
        if self._promoter is None or k in self._failed_promotions:
            return LookupResult.MISS
        if not any(t.contains([k], [self.root])[0] for t in self.chain.lower):
            return LookupResult.MISS
        # NOTE: read and decode off the scheduler's thread; the next lookups answer RETRY until it is done
        self._promoting[k] = self._promoter.submit(self.chain.promote, [k], [self.root])
        self.counters["promotions"] += 1
        return LookupResult.RETRY

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
        """Queue the job's copies on the copy stream; get_finished_jobs reports it once its event is set."""
        keys = [self.key_of(k) for k in job_metadata.keys]
        ids = [int(i) for i in job_metadata.chunk_ids]
        job = _Job(job_metadata.job_id, is_load, len(keys), time.monotonic(), ok_keys=[])
        copy = self._load_chunks if is_load else self._store_chunks
        offload_keys = list(job_metadata.keys)
        self._stream.run(lambda _: copy(job, keys, ids, offload_keys))
        job.event = self._stream.record()
        self._jobs[job.job_id] = job

    def _store_chunks(self, job: _Job, keys: list[bytes], ids: list[int], offload_keys: list) -> None:
        """On the copy thread: primary-tier chunks into the shared tier."""
        n = self.chunk_bytes
        for k, cid, ok in zip(keys, ids, offload_keys):
            r = self.store.reserve(k, n, namespace=self.root, tokens=self.tokens_per_chunk)
            if isinstance(r, PutResult):
                if r in (PutResult.EXISTS, PutResult.BUSY):
                    self.counters["already_held"] += 1
                    job.ok_keys.append(ok)
                else:
                    self.counters["not_stored"] += 1
                    job.failed += 1
                continue
            try:
                np.copyto(np.frombuffer(r.view(), dtype=np.uint8), self._primary[cid * n:(cid + 1) * n])
            except BaseException:
                r.abort()
                job.failed += 1
                raise
            if r.commit() is PutResult.OK:
                self.counters["stored"] += 1
                job.ok_keys.append(ok)
                job.nbytes += n
            else:
                job.failed += 1

    def _load_chunks(self, job: _Job, keys: list[bytes], ids: list[int], offload_keys: list) -> None:
        """On the copy thread: shared-tier chunks into the primary tier."""
        n = self.chunk_bytes
        for k, cid, ok in zip(keys, ids, offload_keys):
            lease = self.store.acquire(k)
            if lease is None:
                self.counters["load_missing"] += 1
                job.failed += 1
                continue
            try:
                if lease.size != n or lease.compressed:
                    job.failed += 1  # another layout's chunk, or re-encoded by /compress: not served here
                    continue
                np.copyto(self._primary[cid * n:(cid + 1) * n], np.frombuffer(lease.view(), dtype=np.uint8))
            finally:
                good = lease.release()
            if good:
                self.counters["loaded"] += 1
                job.ok_keys.append(ok)
                job.nbytes += n
            else:
                job.failed += 1  # reclaimed meanwhile: the bytes may be wrong

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
            if not job.is_load and job.ok_keys and self._offloading_spec.config.enable_kv_cache_events:
                self._events.append(OffloadingEvent(keys=list(job.ok_keys), medium=Medium.CPU, removed=False,
                                                    ownership=self.tier_type))
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
        out, self._events = self._events, []
        return out

    def on_new_request(self, req_context: ReqContext) -> _RequestContext:
        return _RequestContext()

    def shutdown(self) -> None:
        self.drain_jobs()
        self._stream.close()
        self._primary = None  # vLLM unmaps the primary region after this: no export of it may remain
        if self._promoter is not None:
            self._promoter.shutdown(wait=True)
        if self._maintainer_role is not None:
            self._maintainer_role.stop()
        self.chain.close()
        if self.remote is not None:
            self.remote.flush(timeout_s=10)
            self.remote.close()
        self.store.close()


def _dtype_bytes(name: str) -> int:
    try:
        import torch

        return torch.empty((), dtype=getattr(torch, str(name).replace("torch.", ""))).element_size()
    except Exception:
        return 2
