"""ShmKVConnector: vLLM instances on one host share KV through one shmkv segment.

Load it with
    kv_transfer_config={"kv_connector": "ShmKVConnector",
                        "kv_connector_module_path": "shmkv.integration.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {...}}

vLLM builds this class twice (notes/vllm_connector_api.md §1):
  * SCHEDULER role (EngineCore process): hashes prompts into unit keys, asks
    the segment for the longest cached prefix (one batched lookup), tells vLLM
    how many tokens it can load, and each step ships the load/store plan to the
    workers in ShmKVMetadata.
  * WORKER role (one per TP rank): loads synchronously in start_load_kv
    (before the forward pass) and stores in wait_for_save (after it).
The two halves share nothing but that metadata and the segment itself. With
no daemon running, the first process to start creates the segment and the
others attach (embedded default).

Roles: kv_producer only stores, kv_consumer only loads, kv_both does both.
Failures inside the connector are logged and counted; the request then runs
without the cache (vLLM is told to recompute blocks that could not be loaded).

Hybrid models: the connector declares SupportsHMA, so vLLM keeps its hybrid
KV-cache manager on. Every KV-cache group is copied with its own block ids;
full-attention and sliding-window groups are supported (planner.py says what
a sliding-window group stores). A group of any other kind (Mamba or other
linear-attention state, chunked local attention, ...) turns the connector
off for that engine with one log line, and vLLM serves as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from shmkv.config import ShmkvConfig, load_config
from shmkv.errors import ConfigError
from shmkv.integration.vllm.planner import NULL_BLOCK, LoadItem, Planner, RequestPlan, StoreItem
from shmkv.keys import ExtraInputs, MultiModalItem, Namespace
from shmkv.namespaces import register
from shmkv.remote import open_remote
from shmkv.store import open_store
from shmkv.tiers import TierChain

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

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


class _AskAgain(Exception):
    """A promotion for the request is still running."""


@dataclass
class RequestSummary:
    req_id: str
    prompt_tokens: int
    local_tokens: int
    hit_tokens: int


@dataclass
class ShmKVMetadata(KVConnectorMetadata):
    loads: list[LoadItem] = field(default_factory=list)
    stores: list[StoreItem] = field(default_factory=list)
    summaries: dict[str, RequestSummary] = field(default_factory=dict)
    # blocks promised to vLLM whose loads could not be planned: the worker reports them as load errors
    failed_blocks: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group of the engine: its layers and sliding window (0: full attention)."""

    layer_names: tuple[str, ...]
    window: int = 0


def kv_groups_of(kv_cache_config: KVCacheConfig | None, block_size: int) -> tuple[list[KVGroup], str | None]:
    """The engine's KV-cache groups, or the reason shmkv cannot copy them exactly."""
    if kv_cache_config is None:
        return [KVGroup(())], None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        if getattr(g, "is_eagle_group", False):
            return [], f"KV-cache group {i} holds speculative-decoding (EAGLE) draft layers"
        if not getattr(g, "enable_kv_transfer", True):
            return [], f"KV-cache group {i} is rebuilt by vLLM after a transfer (not transferable state)"
        if spec.block_size != block_size:
            return [], f"KV-cache group {i} ({kind}) has block size {spec.block_size}, not {block_size}"
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            groups.append(KVGroup(tuple(g.layer_names)))
        elif type(spec) is SlidingWindowSpec and not spec.extra_retained_tokens:
            groups.append(KVGroup(tuple(g.layer_names), int(spec.sliding_window)))
        else:
            return [], (f"KV-cache group {i} is {kind} (layers {', '.join(g.layer_names[:3])}"
                        f"{', ...' if len(g.layer_names) > 3 else ''}): shmkv copies attention KV only, and "
                        "this state cannot be restored exactly from chunks")
    return groups, None


def groups_field(groups: list[KVGroup]) -> tuple[tuple[str, str], ...]:
    """Namespace field of a hybrid engine's groups (none for one full-attention group, so
    plain models keep their keys): the payload's sections follow them."""
    if len(groups) == 1 and not groups[0].window:
        return ()
    return (("kv_groups", ";".join(f"{g.window}:{','.join(g.layer_names)}" for g in groups)),)


def namespace_for(vllm_config: VllmConfig, cfg: ShmkvConfig, tp_rank: int) -> Namespace:
    """Everything that makes KV bytes of this engine incompatible with another's."""
    from vllm.platforms import current_platform

    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(mc.dtype).replace("torch.", "")
    cache_dtype = cc.cache_dtype if cc.cache_dtype != "auto" else dtype
    block_size = cc.block_size
    on_cpu = current_platform.is_cpu()
    isa = ""
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(mc.dtype, block_size, mc.get_head_size(),
                            cc.cache_dtype if cc.cache_dtype != "auto" else None)
    return Namespace(
        model_id=str(mc.model),
        dtype=cache_dtype,
        num_layers=mc.get_num_layers(pc),
        num_kv_heads=mc.get_num_kv_heads(pc),
        head_size=mc.get_head_size(),
        chunk_size=cfg.chunk_size,
        mla=bool(mc.use_mla),
        tp_size=pc.tensor_parallel_size,
        tp_rank=tp_rank,
        payload="blocks" if on_cpu else "tokens",
        attention_layout="cpu:LBHNC" if on_cpu else ("cuda:mla" if mc.use_mla else "cuda:paged"),
        block_size=block_size,
        isa=isa,
    )


def prompt_tokens(request: Request) -> np.ndarray:
    """The prompt's token ids as vLLM computes with them: positions given as
    embeddings hold 0 (their content is in request_extras)."""
    n = int(request.num_prompt_tokens)
    if request.prompt_token_ids is not None and getattr(request, "prompt_is_token_ids", None) is None:
        return np.asarray(request.prompt_token_ids, dtype=np.int64)
    return np.asarray(request.all_token_ids[:n], dtype=np.int64)


def request_extras(request: Request) -> ExtraInputs | None:
    """The multimodal items and prompt embeddings of a request (None: it has neither)."""
    mm = tuple(MultiModalItem(str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length))
               for f in (getattr(request, "mm_features", None) or ()))
    embeds = getattr(request, "prompt_embeds", None)
    mask = getattr(request, "prompt_is_token_ids", None)
    if not mm and embeds is None:
        return None
    arr = None
    if embeds is not None:
        t = embeds.detach().to("cpu").contiguous()
        arr = t.view(torch.uint8).numpy().reshape(t.shape[0], -1)  # raw bytes per position (bf16 has no numpy dtype)
    return ExtraInputs(mm=mm, embeds=arr, token_mask=None if mask is None else np.asarray(mask, dtype=bool))


_LORA_DIGESTS: dict[tuple, str] = {}


def lora_extra(request: Request) -> tuple[tuple[str, str], ...]:
    """Namespace fields of the request's LoRA adapter: its name and a digest
    of its files (cached by path, size, mtime and inode, so an adapter
    replaced under the same name gets a new digest)."""
    lr = getattr(request, "lora_request", None)
    if not lr:
        return ()
    return (("lora_name", str(lr.lora_name)), ("lora_digest", lora_digest(str(lr.lora_path or ""))))


def lora_digest(path: str) -> str:
    """xxh3-128 over the adapter directory's regular files (names and bytes)."""
    import xxhash

    try:
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
        stats = tuple((n, st.st_size, st.st_mtime_ns, st.st_ino)
                      for n in names for st in [os.stat(os.path.join(path, n))])
    except OSError:
        log.warning("shmkv: LoRA adapter path %r is not a readable directory: its keys name the path only "
                    "(a different adapter at the same path would share them)", path)
        return "path:" + path
    key = (path, stats)
    d = _LORA_DIGESTS.get(key)
    if d is None:
        h = xxhash.xxh3_128()
        for n in names:
            h.update(n.encode() + b"\x00")
            with open(os.path.join(path, n), "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        d = _LORA_DIGESTS[key] = h.hexdigest()
    return d


class ShmKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if pp > 1:
            raise ConfigError(f"shmkv does not support pipeline parallelism (pipeline_parallel_size={pp}): its "
                              "keys do not name a pipeline stage. Use pipeline_parallel_size=1 (tensor parallelism "
                              "is supported), or run this engine without the shmkv connector")
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        self.cfg = load_config(extra)
        _setup_logging(self.cfg.log_level)
        self.loads_enabled = ktc.is_kv_consumer
        self.stores_enabled = ktc.is_kv_producer
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._kv_role_name = role.name.lower()
        self._groups, self.off_reason = kv_groups_of(kv_cache_config, self.block_size)
        self._worker = None
        self._maintainer_role = None
        self._promoter = None
        self.remote = None
        self._load_errors: set[int] = set()  # worker: blocks vLLM must recompute
        self._finished_waiting: set[str] = set()
        self._loading: ShmKVMetadata | None = None
        if self.off_reason is not None:
            # NOTE: one line per engine (the scheduler's); vLLM serves as if no connector were set.
            (log.warning if role == KVConnectorRole.SCHEDULER else log.debug)(
                "shmkv: connector off for this engine: %s; vLLM serves without the shared cache", self.off_reason)
            self.loads_enabled = self.stores_enabled = False
            self.store = None
            return
        self.store = open_store(self.cfg)
        self._base_ns = [dataclasses.replace(n, extra=n.extra + groups_field(self._groups))
                         for n in (namespace_for(vllm_config, self.cfg, r) for r in range(self.tp_size))]
        self._planners: dict[str | None, Planner] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(ktc)
        else:
            self._tp_rank = self._get_tp_rank()
        log.info("shmkv: %s connector ready (role %s, chunk %d tokens, block %d, loads %s, stores %s)",
                 role.name.lower(), ktc.kv_role, self.cfg.chunk_size, self.block_size,
                 "on" if self.loads_enabled else "off", "on" if self.stores_enabled else "off")

    # ================================================================ common
    def _planner(self, salt: str | None, lora: tuple[tuple[str, str], ...] = ()) -> Planner:
        """The planner of one namespace: the engine's, with the request's cache
        salt and LoRA adapter (`lora`: namespace extra fields, lora_extra())."""
        p = self._planners.get((salt, lora))
        if p is None:
            ns = [dataclasses.replace(n.with_salt(salt), extra=n.extra + lora) for n in self._base_ns]
            p = Planner(ns, self.block_size, store_tail=self.cfg.store_tail,
                        windows=[g.window for g in self._groups])
            self._planners[(salt, lora)] = p
        return p

    def _dtype_bytes(self) -> int:
        """Element size of the byte-plane shuffle of stored chunks."""
        return self.cfg.disk_shuffle_bytes or torch.empty(
            (), dtype=self._vllm_config.model_config.dtype).element_size()

    @staticmethod
    def _get_tp_rank() -> int:
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            return get_tensor_model_parallel_rank()
        except Exception:
            return 0

    # ============================================================ scheduler
    def _init_scheduler(self, ktc: Any) -> None:
        self._plans: dict[str, RequestPlan] = {}
        self._pending_loads: dict[str, RequestPlan] = {}
        self._asked: set[str] = set()
        self._promotions: dict[str, Future] = {}
        self._promoted: set[str] = set()  # promotion done: look up in memory only
        self.counters: dict[str, int] = {"lookup_errors": 0, "requests": 0, "hit_requests": 0}
        self.disk = None
        self._promoter: ThreadPoolExecutor | None = None
        if groups_field(self._groups):
            log.info("shmkv: hybrid KV cache, %d groups: %s", len(self._groups), "; ".join(
                f"{len(g.layer_names)} layers with " + (f"a {g.window}-token sliding window" if g.window
                                                       else "full attention") for g in self._groups))
        for rank, ns in enumerate(self._base_ns):
            # operators name a namespace by this root in the controller API (lookup, clear, pin...)
            log.info("shmkv: namespace of TP rank %d: root %s (model %s, %s, %d layers)", rank,
                     register(self.cfg.cache_name, ns), ns.model_id, ns.dtype, ns.num_layers)
        if self.cfg.disk_dir:
            from shmkv.disk.tier import DiskTier

            self.disk = DiskTier(os.path.join(self.cfg.disk_dir, self.cfg.cache_name),
                                 capacity_bytes=self.cfg.disk_capacity, level=self.cfg.disk_level,
                                 element_size=self._dtype_bytes(),
                                 counter=self.store.bump)
            log.info("shmkv: disk tier at %s (cap %.1f GiB, zstd level %d)", self.disk.dir,
                     self.cfg.disk_capacity / 2**30, self.cfg.disk_level)
        self.remote = open_remote(self.cfg, store=self.store, disk=self.disk, element_size=self._dtype_bytes())
        self.chain = TierChain(self.store, [self.disk, self.remote])
        if self.chain.lower:
            # NOTE: promotion reads and decompresses off the scheduler's thread
            self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmkv-promote")
        # NOTE: not `_role`: KVConnectorBase_V1 keeps vLLM's KVConnectorRole there.
        if self.cfg.maintainer:
            from shmkv.maintainer import MaintainerRole

            self._maintainer_role = MaintainerRole(self.cfg, self.store, self.disk, remote=self.remote)
            self._maintainer_role.start()
        if self.cfg.load_failure_policy == "recompute" and ktc.kv_load_failure_policy != "recompute":
            # A chunk evicted between lookup and load must mean "recompute it",
            # never a failed request. vLLM reads this after building us.
            ktc.kv_load_failure_policy = "recompute"
            log.info("shmkv: set kv_load_failure_policy=recompute (a cache miss at load time is recomputed)")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.off_reason is not None:
            return 0, False
        try:
            tokens = prompt_tokens(request)
            # the request's cache salt and LoRA adapter are in every key it reads or writes,
            # its multimodal items and prompt embeddings in the keys of the chunks they cover
            # (computed once per request: vLLM may ask again every step until it admits it)
            plan = self._plans.get(request.request_id)
            if plan is None or plan.prompt_len != len(tokens):
                planner = self._planner(getattr(request, "cache_salt", None), lora_extra(request))
                extras = request_extras(request)
                plan = RequestPlan(request.request_id, len(tokens), planner.units(tokens, extras), roots=planner.roots)
                plan.extras, plan.planner = extras, planner
                self._plans[request.request_id] = plan
            planner = plan.planner
            plan.local_tokens = num_computed_tokens
            if not self.loads_enabled:
                return 0, False
            first = request.request_id not in self._asked
            self._asked.add(request.request_id)
            hit, units, lower = planner.lookup(self.chain, tokens, plan.units, count=first,
                                               lower=self._look_lower(request.request_id), extras=plan.extras)
            if lower:
                # Promote from disk / remote in the background; vLLM asks again next step.
                keys = [k for u in lower for k in u.keys]
                roots = [r for _ in lower for r in planner.roots]
                assert self._promoter is not None
                self._promotions[request.request_id] = self._promoter.submit(
                    self.chain.promote, keys, roots,
                    deadline_s=max(2.0, 4 * self.cfg.remote_timeout) if self.remote is not None else None)
                log.info("shmkv: request %s: %d tokens found on disk or remote, promoting", request.request_id,
                         sum(u.tokens for u in lower))
                return None, False
            extra = max(0, hit - num_computed_tokens)
            extra -= extra % self.block_size  # whole blocks past vLLM's own (aligned) hit
            plan.hit_tokens = extra
            plan.hit_units = units if extra else []
            if first:
                self.counters["requests"] += 1
                self.counters["hit_requests"] += extra > 0
                log.info("shmkv: request %s: prompt %d tokens, vLLM prefix cache %d, shmkv hit %d",
                         request.request_id, len(tokens), num_computed_tokens, extra)
            return extra, False
        except _AskAgain:
            return None, False
        except Exception:
            self.counters["lookup_errors"] += 1
            log.exception("shmkv: lookup for request %s failed; it runs without the cache",
                          getattr(request, "request_id", "?"))
            plan = self._plans.get(getattr(request, "request_id", None))
            if plan is not None:
                plan.hit_tokens, plan.hit_units = 0, []
            return 0, False

    def _look_lower(self, req_id: str) -> bool:
        """Whether this lookup looks below the shared tier: not after a
        promotion for the request (its outcome is final: what did not promote
        is a miss); raises _AskAgain while one runs."""
        fut = self._promotions.get(req_id)
        if fut is None:
            return req_id not in self._promoted
        if not fut.done():
            raise _AskAgain()
        self._promotions.pop(req_id)
        try:
            fut.result()
        except Exception:
            log.exception("shmkv: promotion for request %s failed; it runs with what is in memory", req_id)
        self._promoted.add(req_id)
        return False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.off_reason is not None:
            return
        plan = self._plans.get(request.request_id)
        if plan is None:
            return
        try:
            plan.block_ids = [list(ids) for ids in blocks.get_block_ids()]
        except Exception:
            log.exception("shmkv: cannot read block ids of request %s", request.request_id)
            num_external_tokens = 0
        if num_external_tokens != plan.hit_tokens:
            plan.hit_tokens = num_external_tokens
            if not num_external_tokens:
                plan.hit_units = []
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = plan

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ShmKVMetadata()
        if self.off_reason is not None:
            return meta
        try:
            self._plan_loads(meta)
        finally:
            self._pending_loads.clear()
        try:
            self._build(scheduler_output, meta)
        except Exception:
            log.exception("shmkv: planning the stores of this step failed; they are skipped")
            meta.stores = []
        return meta

    def _plan_loads(self, meta: ShmKVMetadata) -> None:
        """Load items of the requests admitted with a hit. A request whose loads
        cannot be planned has its promised blocks reported as load errors, so
        vLLM recomputes them (never runs on blocks nobody filled)."""
        planner = self._planner(None)  # units carry their own keys: any planner of this geometry
        bs = self.block_size
        for req_id, plan in self._pending_loads.items():
            try:
                meta.loads.extend(planner.load_items(plan))
            except Exception:
                self.counters["lookup_errors"] += 1
                log.exception("shmkv: planning the load of request %s failed; vLLM recomputes it", req_id)
                lo, hi = plan.local_tokens // bs, (plan.local_tokens + plan.hit_tokens) // bs
                meta.failed_blocks.update(b for ids in plan.block_ids for b in ids[lo:hi] if b != NULL_BLOCK)
                continue
            meta.summaries[req_id] = RequestSummary(req_id, plan.prompt_len, plan.local_tokens, plan.hit_tokens)

    def _build(self, so: SchedulerOutput, meta: ShmKVMetadata) -> None:
        planner = self._planner(None)
        # Admitted now: vLLM asks again only if it preempts the request, and
        # that new admission is counted and logged like a first one.
        for new in so.scheduled_new_reqs:
            self._asked.discard(new.req_id)
        for req_id in so.scheduled_cached_reqs.resumed_req_ids:
            self._asked.discard(req_id)
        if not self.stores_enabled:
            return
        for new in so.scheduled_new_reqs:
            plan = self._plans.get(new.req_id)
            if plan is None:  # never seen by get_num_new_matched_tokens: its salt is unknown
                continue
            plan.block_ids = [list(ids) for ids in new.block_ids]
            done = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
            meta.stores.extend(planner.store_items(plan, done))
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
            meta.stores.extend(planner.store_items(plan, done))

    def update_connector_output(self, connector_output: Any) -> None:
        return

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when the hybrid KV-cache manager is on (SupportsHMA)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.off_reason is not None:
            return False, None
        plan = self._plans.pop(request.request_id, None)
        if plan is not None and plan.window_skipped:
            log.debug("shmkv: request %s: %d chunks not stored (their sliding window held vLLM's null block)",
                      request.request_id, plan.window_skipped)
        self._asked.discard(request.request_id)
        self._promotions.pop(request.request_id, None)
        self._promoted.discard(request.request_id)
        self._pending_loads.pop(request.request_id, None)
        # GPU stores complete asynchronously: keep the blocks until the worker
        # reports the request in finished_sending.
        from vllm.platforms import current_platform

        delay = bool(plan and plan.stored_any and not current_platform.is_cpu())
        return delay, None

    def reset_cache(self) -> bool | None:
        """vLLM's reset_prefix_cache(reset_connector=True) (and the server's
        /reset_prefix_cache?reset_external=true): remove this engine's chunks
        (every namespace it used: its own, salted and LoRA ones) from every
        tier; other engines' chunks stay. False when the table lock could not
        be had."""
        if self._kv_role_name != "scheduler" or self.off_reason is not None:
            return None
        from shmkv.errors import LockTimeoutError

        roots = {r for p in self._planners.values() for r in p.roots}
        roots |= {ns.root_key() for ns in self._base_ns}
        removed = {"shm": 0, "disk": 0, "remote": 0}
        try:
            for root in sorted(roots):
                for tier, n in self.chain.clear(root).items():
                    removed[tier] += n
        except LockTimeoutError as e:
            log.warning("shmkv: reset_cache could not finish: %s", e)
            return False
        log.info("shmkv: reset_cache removed this engine's chunks (%d namespaces): %d in memory, %d on disk, "
                 "%d in the remote", len(roots), removed["shm"], removed["disk"], removed["remote"])
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    # =============================================================== worker
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.off_reason is not None:
            return
        from shmkv.integration.vllm.worker import KVWorker
        from shmkv.layout import KVLayout

        first = next(iter(kv_caches.values()))
        if first.device.type == "cpu":
            kind = "cpu"
        else:
            kind = {4: "hnd", 5: "kv_split", 3: "mla"}.get(first.dim(), "")
        groups = [g.layer_names or tuple(kv_caches) for g in self._groups]
        layouts = [KVLayout(kind, [kv_caches[n] for n in names], names) for names in groups]
        remote = None
        if self.cfg.remote_write_through:
            remote = open_remote(self.cfg, store=self.store, disk=None,
                                 element_size=self.cfg.disk_shuffle_bytes or first.element_size())
        self._worker = KVWorker(self.store, layouts, self._tp_rank, digest_file=self.cfg.debug_digest_file,
                                remote=remote, layer_order=list(kv_caches))
        log.info("shmkv: registered %d KV layers in %d group(s) (%s layout, %s, %.1f KiB per token)",
                 len(kv_caches), len(layouts), kind, str(first.dtype).replace("torch.", ""),
                 sum(lay.bytes_per_token() for lay in layouts) / 1024)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, ShmKVMetadata) and connector_metadata.failed_blocks:
            self._load_errors |= connector_metadata.failed_blocks
        if self._worker is not None and self._worker.on_gpu and any(g.window for g in self._groups):
            # NOTE: vLLM frees sliding-window blocks as a request advances and may hand them
            # to this step's forward: it must not overwrite them before last step's stores
            # have read them (the compute stream waits on their events; the host does not).
            self._worker.order_compute_after_stores()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, ShmKVMetadata) or not meta.loads or self._worker is None:
            return
        self._loading = meta
        self._worker.start_load(meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._loading is not None and self._worker is not None:
            self._worker.wait_layer(layer_name)

    def _finish_load(self) -> None:
        meta, self._loading = self._loading, None
        if meta is None or self._worker is None:
            return
        failed, done = self._worker.finish_load()
        self._load_errors |= failed
        for req_id, (tokens, seconds) in done.items():
            s = meta.summaries.get(req_id)
            log.info("shmkv: request %s: prompt %d tokens, hit %d (vLLM prefix cache %d), loaded %d in %.1f ms%s",
                     req_id, s.prompt_tokens if s else -1, (s.local_tokens + s.hit_tokens) if s else -1,
                     s.local_tokens if s else -1, tokens, seconds * 1e3,
                     f", {len(failed)} blocks to recompute" if failed else "")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # all layers of a unit are gathered at once in wait_for_save

    def wait_for_save(self) -> None:
        self._finish_load()  # the forward pass is over: release this step's leases
        meta = self._connector_metadata
        if self._worker is None:
            return
        if isinstance(meta, ShmKVMetadata) and meta.stores:
            self._worker.store(meta.stores)
        self._worker.poll()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        self._worker.poll()
        for req_id in finished_req_ids:
            t = self._worker.finish(req_id)
            if t and (t.stored_units or t.already_cached or t.not_stored):
                log.info("shmkv: request %s: stored %d tokens in %d chunks (%.1f ms); %d already cached, %d not stored",
                         req_id, t.stored_tokens, t.stored_units, t.store_s * 1e3, t.already_cached, t.not_stored)
        if not self._worker.on_gpu:
            return None, None
        self._finished_waiting |= finished_req_ids
        pending = self._worker.pending_requests()
        done = {r for r in self._finished_waiting if r not in pending}
        self._finished_waiting -= done
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_load()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._maintainer_role is not None:
            self._maintainer_role.stop()
        if self._promoter is not None:
            self._promoter.shutdown(wait=True)
        if self.remote is not None:
            self.remote.flush(timeout_s=10)
            self.remote.close()
        log.info("shmkv: %s connector shut down", self._kv_role_name)

