"""ShmKVConnector: vLLM instances on one host share KV through one shmkv segment.

Load it with
    kv_transfer_config={"kv_connector": "ShmKVConnector",
                        "kv_connector_module_path": "shmkv.integration.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}

vLLM builds this class twice, once per role (vllm/distributed/kv_transfer/kv_connector/v1/base.py):
  * SCHEDULER role (EngineCore process): hashes prompts into unit keys, asks
    the tier chain (shmkv.tiers: the segment, then disk and remote) for the
    longest cached prefix, promotes what lies below the segment off its
    thread, tells vLLM how many tokens it can load, and each step ships the
    load/store plan to the workers in ShmKVMetadata.
  * WORKER role (one per TP rank): issues loads in start_load_kv (before
    the forward pass; each attention layer waits for its own; engines of
    several KV-cache groups load asynchronously, worker.py) and stores in
    wait_for_save (after it); stores complete asynchronously on every
    platform, through vLLM's delayed frees (worker.py).
The two halves share nothing but that metadata and the segment itself. With
no daemon running, the first process to start creates the segment and the
others attach (embedded default). This class is a thin front, as vLLM's own
OffloadingConnector is: each call goes to the scheduler-side object
(scheduler.py) or the worker-side one (worker.py) of this process's role.

On or off, one decision per engine: the connector serves an engine only if
its scheduler half and every worker can. Each worker reports at start
(vLLM's handshake, before the first request) whether it can copy the
engine's KV cache; the scheduler half turns itself off on any refusal, says
so once at WARNING, and then plans nothing and never delays a free. An off
worker still answers vLLM's protocol (worker.py), so no request can wait on
it.

Roles: kv_producer only stores, kv_consumer only loads, kv_both does both.
Failures inside the connector are logged and counted; the request then runs
without the cache (vLLM is told to recompute blocks that could not be loaded).

Hybrid models: the connector declares SupportsHMA, so vLLM keeps its hybrid
KV-cache manager on. Every KV-cache group is copied with its own block ids;
full-attention and sliding-window groups are supported (planner.py says what
a sliding-window group stores), and linear-attention state (Mamba, gated
delta net) in vLLM's align mode (prefix caching on): the state vLLM keeps at
a block boundary is stored beside the chunk ending there and loaded with the
attention KV of a hit ending there. A group of any other kind (linear
attention without align mode, chunked local attention, ...) turns the
connector off for that engine with one log line, and vLLM serves as usual.

Speculative decoding: a drafter's KV layers (draft_model, EAGLE, EAGLE-3,
MTP; in their own group or in the target's) are copied with the target's,
in a namespace that names the drafter; an EAGLE/MTP drafter wrote the KV of
a chunk's last positions from the prompt tokens after it, so those chunks
are keyed with them too (shmkv.chunking). ngram and suffix decoding add no
KV: their engines share chunks with plain ones. vLLM then calls get_finished
before wait_for_save in a step (worker.py holds for that).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from shmkv import engine_registry
from shmkv.config import load_config
from shmkv.errors import ConfigError, StoreInUseError
from shmkv.integration.vllm import adapters
from shmkv.integration.vllm.engine_inputs import (
    chunk_bytes,
    drafter_field,
    groups_field,
    kv_groups_of,
    max_chunk_bytes,
    model_config_field,
    namespace_for,
    stores_on_rank,
)
from shmkv.integration.vllm.kv_events import event_groups_of
from shmkv.integration.vllm.loaded_weights import TensorsDigest, loaded_digest
from shmkv.integration.vllm.metadata import ShmKVMetadata, ShmKVWorkerReport
from shmkv.integration.vllm.metrics import HIT_SOURCES, ShmKVPromMetrics, ShmKVStats
from shmkv.integration.vllm.versions import check_vllm_version
from shmkv.integration.vllm.weights import WorkerWeights, board_id, engine_weights, find_models, tp_rank
from shmkv.integration.vllm.worker import WorkerSide
from shmkv.store import open_store
from shmkv.testing import WORKER_OFF
from shmkv.testing import switches as test_switches

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ShmKVConnector", "ShmKVMetadata"]

log = logging.getLogger("shmkv.connector")


def _setup_logging(level: str) -> None:
    root = logging.getLogger("shmkv")
    root.setLevel(level.upper())
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [shmkv pid %(process)d] %(message)s",
                                         "%m-%d %H:%M:%S"))
        root.addHandler(h)
        root.propagate = False


def _require_cuda_kernels_if_on_cuda() -> None:
    """On a CUDA platform the KV cache is copied by shmkv._C_cuda: without it,
    stop now (before vLLM loads the model), naming the fix."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return
    from shmkv.errors import InvalidArgumentError
    from shmkv.transfer import gpu

    try:
        gpu.extension()
    except InvalidArgumentError as e:
        raise ConfigError(f"{e}. Rebuild shmkv where nvcc is found (pip install --no-build-isolation -e . with "
                          "CUDA_HOME or nvcc on PATH; docs/install.md 'GPU hosts'), or run this engine without the "
                          "shmkv connector") from e


def layers_read_without_hooks(forward_context: dict[str, Any], names: Any, state_layers: set[str]) -> list[str]:
    """The KV-cache layers an op reads without vLLM's per-layer load hook:
    vLLM calls wait_for_layer_load from its attention ops alone (Attention,
    MLAAttention: maybe_transfer_kv_layer); another layer with a KV cache,
    such as DeepSeek-V3.2's indexer cache (read by sparse_attn_indexer
    before that layer's attention), would read a partly loaded cache. State
    layers are left out: their groups load asynchronously. A layer missing
    from vLLM's forward context is taken as hooked (vLLM registers every
    layer it builds there)."""
    try:
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:  # a vLLM that moved them: every layer is waited for before the forward
        return [n for n in names if n not in state_layers]
    return [n for n in names if n not in state_layers and n in forward_context
            and not isinstance(forward_context[n], (Attention, MLAAttention))]


def _no_layer_hooks(forward_context: Any, load_kwargs: dict[str, Any]) -> bool:
    """Whether this step's forward runs without wait_for_layer_load: a FULL
    CUDA graph replay (vLLM's cudagraph_mode FULL_AND_PIECEWISE uses one for
    uniform-decode-shaped batches, which a load step can be: a full hit
    leaving one token, or k+1 with speculative decoding). V1 says so in the
    forward context; Model Runner V2's FULL branch calls start_load_kv
    outside any forward (a context without attention metadata), passing the
    step's attn_metadata (vllm/v1/worker/gpu/kv_connector.py); no other V2
    call passes it."""
    from vllm.config import CUDAGraphMode

    if getattr(forward_context, "cudagraph_runtime_mode", CUDAGraphMode.NONE) == CUDAGraphMode.FULL:
        return True
    return load_kwargs.get("attn_metadata") is not None or getattr(forward_context, "attn_metadata", None) is None


def _runs_v2(vllm_config: Any) -> bool:
    """Model Runner V2 (what a GPU runs by default in vLLM 0.32)."""
    try:
        return bool(vllm_config.use_v2_model_runner)
    except Exception:  # it raises where V2 was asked for and cannot run; the engine then fails itself
        return False


def context_parallel_refusal(parallel_config: Any) -> str | None:
    """Why decode/prefill context parallelism cannot be served (None: it is off):
    its ranks hold the KV of different tokens, shmkv's chunks hold every token's."""
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        n = getattr(parallel_config, name, 1) or 1
        if n > 1:
            return (f"{name}={n}: context parallelism shards the KV cache by token across ranks, and shmkv's "
                    f"chunks hold every token's KV of a TP rank; set {name}=1 to use shmkv")
    return None


def _calling_scheduler(connector: Any) -> Any:
    """vLLM's Scheduler that called the connector (the caller's frame: the
    connector gets no reference to it), or None."""
    frame = sys._getframe(2)
    owner = frame.f_locals.get("self") if frame is not None else None
    return owner if getattr(owner, "connector", None) is connector else None


class ShmKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        check_vllm_version()
        super().__init__(vllm_config, role, kv_cache_config)
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:
            raise ConfigError(f"shmkv does not support pipeline parallelism (pipeline_parallel_size={pp}): its "
                              "keys do not name a pipeline stage. Use pipeline_parallel_size=1 (tensor parallelism "
                              "is supported), or run this engine without the shmkv connector")
        ktc = self._kv_transfer_config
        self.cfg = load_config(dict(ktc.kv_connector_extra_config or {}))
        _setup_logging(self.cfg.log_level)
        self._kv_role_name = role.name.lower()
        block_size = vllm_config.cache_config.block_size
        groups, self.off_reason = kv_groups_of(kv_cache_config, block_size)
        self.off_reason = self.off_reason or context_parallel_refusal(vllm_config.parallel_config)
        worker_off = test_switches().worker_off
        if worker_off and role == KVConnectorRole.WORKER and self.off_reason is None:
            # a test's: the split a worker-only reason makes (scheduler on, workers off)
            self.off_reason = f"{WORKER_OFF}: {worker_off}"
        # NOTE: not `_role`: KVConnectorBase_V1 keeps vLLM's KVConnectorRole there.
        self._sched = None
        self._work = None
        self._weights: WorkerWeights | None = None
        self._tensors_digest: TensorsDigest | None = None  # this rank's weights as loaded (the handshake's)
        self.store = None
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._on_reported: bool | None = None  # the connector_on gauge, as last sent to vLLM's metrics
        self._model = str(vllm_config.model_config.model)
        if self.off_reason is not None:
            # one line per engine (the scheduler's); vLLM serves as if no connector were set
            if role == KVConnectorRole.SCHEDULER:
                self._say_off(self.off_reason)
            else:  # it still answers vLLM's protocol (delayed frees, loads) until the scheduler half knows
                log.debug("shmkv: worker connector off: %s", self.off_reason)
                self._work = WorkerSide(self.cfg, None, [], tp_rank(), block_size, off_reason=self.off_reason)
            return
        _require_cuda_kernels_if_on_cuda()
        # The scheduler copies only what it promotes from disk or remote: its mapping
        # is faulted in on first touch, not populated (seconds of CPU at start, and
        # page tables to tear down at exit, in the process vLLM kills after 5 s).
        self.store = open_store(self.cfg, populate=self.cfg.populate and role != KVConnectorRole.SCHEDULER)
        if role == KVConnectorRole.SCHEDULER:
            from shmkv.integration.vllm.scheduler import SchedulerSide

            tp = vllm_config.parallel_config.tensor_parallel_size
            weights = engine_weights(vllm_config)
            fields = model_config_field(vllm_config) + groups_field(groups) + drafter_field(vllm_config)
            namespaces = [dataclasses.replace(n, extra=n.extra + fields)
                          for n in (namespace_for(vllm_config, self.cfg, r) for r in range(tp))]
            self._sched = SchedulerSide(vllm_config, self.cfg, self.store, namespaces, groups,
                                        loads=ktc.is_kv_consumer, stores=ktc.is_kv_producer, ktc=ktc,
                                        weights=weights,
                                        max_chunk_bytes=max_chunk_bytes(kv_cache_config, self.cfg.chunk_size),
                                        chunk_bytes=chunk_bytes(kv_cache_config, self.cfg.chunk_size),
                                        event_groups=event_groups_of(kv_cache_config))
        else:
            rank = tp_rank()
            self._work = WorkerSide(self.cfg, self.store, groups, rank, block_size,
                                    stores=stores_on_rank(vllm_config, rank),
                                    writes_before_hooks=_runs_v2(vllm_config))
            if vllm_config.lora_config is not None:
                adapters.track()  # which LoRA adapter this rank reads under each id (adapters.py)
        log.info("shmkv: %s connector ready (role %s, chunk %d tokens, block %d, loads %s, stores %s)",
                 self._kv_role_name, ktc.kv_role, self.cfg.chunk_size, block_size,
                 "on" if ktc.is_kv_consumer else "off", "on" if ktc.is_kv_producer else "off")

    # ============================================================ handshake
    def get_handshake_metadata(self) -> ShmKVWorkerReport | None:
        """Worker: whether it can serve this engine, once its KV caches are registered."""
        w = self._work
        if w is None:
            return None
        d = self._tensors_digest
        return ShmKVWorkerReport(w.tp_rank, w.off_reason, w.sections, weights=d.digest if d else "",
                                 weights_basis=d.basis if d else "")

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Scheduler: every worker's start report (before the first request).
        One refusal, or a rank that did not report, turns the connector off
        for the engine; per-shape payload sections name the namespace."""
        if self._sched is None:
            return
        reports = {r: m for r, m in (metadata or {}).items() if isinstance(m, ShmKVWorkerReport)}
        missing = sorted(set(range(self._tp_size)) - set(reports))
        off = [(r, m.off_reason) for r, m in sorted(reports.items()) if m.off_reason is not None]
        if missing:
            off.append((missing[0], "it gave no start report (not shmkv's worker connector?)"))
        if off:
            rank, reason = off[0]
            self._turn_off(f"TP rank {rank}'s worker cannot serve it: {reason}")
            return
        sections = {r: m.sections for r, m in reports.items() if m.sections}
        if sections:
            self._sched.name_sections(sections)
        self._sched.weights.set_tensors({r: (m.weights, m.weights_basis) for r, m in reports.items()})
        self._sched.announce_namespaces()
        engine_registry.record(self.cfg.cache_name, self._model, True)

    def _say_off(self, reason: str) -> None:
        """The engine's one line (the scheduler's) and its entry in the engine registry (shmkv stats)."""
        log.warning("shmkv: connector off for this engine: %s; vLLM serves without the shared cache", reason)
        engine_registry.record(self.cfg.cache_name, self._model, False, reason)

    def _turn_off(self, reason: str) -> None:
        """The scheduler half stops for this engine: no lookups, no stores, no delayed frees."""
        self.off_reason = reason
        self._say_off(reason)
        sched, self._sched = self._sched, None
        if sched is not None:
            sched.shutdown()
        self._detach()

    def _detach(self) -> None:
        """This engine's mapping of the segment closed (what it stored stays)."""
        if self.store is not None:
            try:
                self.store.close()
                self.store = None
            except StoreInUseError as e:  # a copy of this process still holds a lease: the mapping stays
                log.warning("shmkv: %s", e)

    # ============================================================ scheduler
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        if not self._sched.prefix_cache_watched:
            self._sched.watch_prefix_cache(_calling_scheduler(self))
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._sched is None:
            return ShmKVMetadata()
        return self._sched.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when the hybrid KV-cache manager is on (SupportsHMA)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        return self._sched.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        """vLLM's connector reset (reset_prefix_cache(reset_connector=True),
        /reset_prefix_cache?reset_external=true, pause, sleep): nothing shared
        is removed; the workers check their weights (scheduler.py)."""
        return None if self._sched is None else self._sched.reset_cache()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's vllm:prompt_tokens_cached_by_source: shmkv's hit tokens by the
        tier they came from (metrics.py)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if self._sched is None or not num_external_tokens:
            return {}
        return {CacheHitSource(HIT_SOURCES[tier]): n
                for tier, n in self._sched.hit_tokens_by_tier(request, num_external_tokens).items()}

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No: a step whose forward replays a FULL CUDA graph (no Python runs
        inside it, so no wait_for_layer_load) makes the compute stream wait
        for all its loads in start_load_kv instead (_no_layer_hooks);
        decode batches keep their full graphs."""
        return False

    # ============================================================== metrics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Worker: what it moved since the last call. Scheduler: the
        connector_on gauge, when it changes (vLLM merges both)."""
        if self._kv_role_name == "scheduler":
            on = self._sched is not None
            if on == self._on_reported:
                return None
            self._on_reported = on
            return ShmKVStats(data={"counters": {}, "observations": {}, "gauges": {"connector_on": int(on)}})
        data = self._work.take_transfer_stats() if self._work is not None else None
        return ShmKVStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return ShmKVStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return ShmKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # =============================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._work is not None:
            self._work.register_kv_caches(kv_caches)
            if self._work.off_reason is None:
                self._work.set_read_without_hooks(
                    layers_read_without_hooks(self._vllm_config.compilation_config.static_forward_context,
                                              kv_caches, self._work.state_layers()))
                if self._tp_size > 1:  # no rank stores over another rank's failed load (rank_failures.py)
                    self._work.share_failures(board_id(self._vllm_config))
                self._watch_weights(kv_caches)

    def _watch_weights(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """This rank's weights identity (its tensors as loaded, for the
        handshake), then its watch over them in memory: a fingerprint now,
        after every load_weights and when the scheduler half asks (weights.py)."""
        t0 = time.perf_counter()
        ctx = self._vllm_config.compilation_config.static_forward_context
        models = find_models(ctx[n] for n in kv_caches if n in ctx)
        if not models:
            log.warning("shmkv: TP rank %d: the model holding the KV-cache layers was not found: weights changed "
                        "in memory are not seen, and the keys name the weight files alone", self._work.tp_rank)
        t1 = time.perf_counter()
        try:
            self._tensors_digest = loaded_digest(models)
        except Exception as e:  # noqa: BLE001 - the keys then name the files (weights.py)
            log.warning("shmkv: TP rank %d: the digest of its weights failed (%s: %s): the keys name the weight "
                        "files alone", self._work.tp_rank, type(e).__name__, e)
        t2 = time.perf_counter()
        self._weights = WorkerWeights(board_id(self._vllm_config), self._work.tp_rank, models)
        if self._vllm_config.lora_config is not None:
            self._work.adapters_held = lambda: adapters.held_adapters(models)
        d = self._tensors_digest
        when = "at load" if d and d.basis == "loaded" else "now"
        what = (f"{d.basis} digest {d.digest[:16]} of {d.tensors} tensors, {d.nbytes / 1e9:.3f} GB in "
                f"{d.seconds:.3f} s ({when})" if d else "no digest of its tensors")
        log.info("shmkv: TP rank %d weights: %s (%s found in %.3f s, fingerprint %.3f s)", self._work.tp_rank, what,
                 ", ".join(type(m).__name__ for m in models) or "no model", t1 - t0, time.perf_counter() - t2)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+ (enable_sleep_mode): yes, unregister_kv_caches drains
        every copy before vLLM frees or remaps the KV cache."""
        return True

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+, before sleep mode frees the KV cache (or discards it):
        every pending store and load is waited for, and no copy touches the
        KV cache until restore_kv_caches. Idempotent."""
        if self._work is not None:
            self._work.suspend()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33+, after wake-up: copies may touch the KV cache again (its
        addresses are the same; its contents are not: vLLM resets its prefix
        cache, and shmkv's chunks were complete before the sleep). Idempotent."""
        if self._work is not None:
            self._work.resume()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        asked = getattr(connector_metadata, "check_weights", 0)
        if self._weights is not None and self._weights.due(asked):
            self._weights.publish(answered=asked)  # loaded, or a prefix-cache reset: they may have changed
        if self._weights is not None and self._weights.failed and self._work is not None:
            self._work.stop(f"its weights check failed ({self._weights.failed})")
        if self._weights is not None and self._work is not None and self._work.adapters_held is not None:
            self._weights.set_adapters(self._work.adapters_held())  # vLLM set this step's adapters already
        if self._work is not None:
            self._work.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before vLLM reuses the blocks of preempted requests (this step)."""
        if self._work is not None:
            self._work.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._work is not None:
            self._work.start_load(self._connector_metadata, whole_forward=_no_layer_hooks(forward_context, kwargs))

    def finish_forward(self) -> None:
        """Model Runner V2, after the target's forward (before a drafter's)."""
        if self._work is not None:
            self._work.finish_forward()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._work is not None:
            self._work.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # all layers of a unit are gathered at once in wait_for_save

    def wait_for_save(self) -> None:
        if self._work is not None:
            self._work.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._work is None:
            return None, None
        return self._work.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """get_finished's sets, and the asynchronous loads that failed (also in finished_recving)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        sending, recving = self.get_finished(finished_req_ids)
        failed = self._work.take_failed_recving() if self._work is not None else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._work is None else self._work.load_errors()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The shared tier's stores and removals, for vLLM's KV-event publisher (kv_events.py)."""
        return self._sched.take_events() if self._sched is not None else ()

    def shutdown(self) -> None:
        """Every copy finished, then the segment detached: an engine ended in
        a process that goes on (an in-process LLM, a notebook, a test) leaves
        no mapping of the segment behind."""
        for side in (self._work, self._sched):
            if side is not None:
                side.shutdown()
        self._detach()
        log.info("shmkv: %s connector shut down", self._kv_role_name)
