"""The connector's scheduler half (vLLM's EngineCore process): turns each
request into units and keys, asks the tier chain for the longest cached
prefix, promotes what lies below the shared tier in the background, tells vLLM
how many tokens it can load, and each step ships the loads and stores of the
admitted and running requests to the workers (ShmKVMetadata).

Everything here is per engine and free of tensors; the planner
(planner.py) does the request and block bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from shmkv.activity import ActivitySummary
from shmkv.config import ShmkvConfig
from shmkv.integration.vllm.adapters import directory_digest, usable
from shmkv.integration.vllm.engine_inputs import (
    KVGroup,
    drafter_lookahead,
    explicit_load_failure_policy,
    groups_field,
    prompt_tokens,
    request_extras,
)
from shmkv.integration.vllm.kv_events import EventGroup, SharedTierEvents
from shmkv.integration.vllm.planner import Planner, RequestPlan
from shmkv.integration.vllm.step_meta import StepMetadata
from shmkv.integration.vllm.weights import EngineWeights
from shmkv.integration.vllm.weights_boards import remove_boards
from shmkv.keys import Namespace, lossy_key
from shmkv.names import DISK, REMOTE, SHM
from shmkv.namespaces import register
from shmkv.store import Store
from shmkv.tiers import open_tiers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

log = logging.getLogger("shmkv.connector")

MAX_PLANNERS = 1024  # namespaces (cache salt x LoRA adapter) whose planners stay cached


# the segment's counter of hit tokens per tier (cpp/counters.h, family hit_tokens)
_HIT_TOKENS_COUNTER = {SHM: "hit_tokens", DISK: "disk_hit_tokens", REMOTE: "remote_hit_tokens"}


class _AskAgain(Exception):
    """A promotion for the request is still running."""


def _render(c: dict, seconds: float) -> str:
    prompt = c.get("prompt_tokens", 0)
    pct = f"{100 * c.get('hit_tokens', 0) / prompt:.1f}%" if prompt else "-"
    return (f"shmkv: last {seconds:.0f} s: {c.get('requests', 0)} requests ({c.get('hit_requests', 0)} with a shmkv "
            f"hit), {c.get('hit_tokens', 0)} of {prompt} prompt tokens from shmkv ({pct}), "
            f"{c.get('local_tokens', 0)} from vLLM's prefix cache, {c.get('promotions', 0)} promotions from "
            f"disk/remote ({c.get('promoted_tokens', 0)} tokens)")


class SchedulerSide(StepMetadata):
    """One engine's scheduler half over one store."""

    def __init__(self, vllm_config: VllmConfig, cfg: ShmkvConfig, store: Store, namespaces: list[Namespace],
                 groups: list[KVGroup], *, loads: bool, stores: bool, ktc: Any, weights: EngineWeights,
                 max_chunk_bytes: int | None = None, event_groups: list[EventGroup] | None = None,
                 chunk_bytes: int = 0) -> None:
        self._vllm_config = vllm_config
        self.cfg = cfg
        self.store = store
        self.block_size = vllm_config.cache_config.block_size
        self.loads_enabled, self.stores_enabled = loads, stores
        self._base_ns = namespaces  # without the weights' fields (self.weights: known from the first step on)
        self.weights = weights
        self._weights_read = False  # the weights' boards were read this step (once per step)
        self._keyed_with: tuple | None = None  # the weights' fields the planners and plans were made with
        self.prefix_cache_watched = False  # watch_prefix_cache
        self._block_pool: Any = None
        self._prefix_map: Any = None
        self._groups = groups
        # NOTE: a load is synchronous (the step's forward waits layer by layer) or asynchronous
        # (vLLM parks the request in WAITING_FOR_REMOTE_KVS until get_finished reports it, and a
        # failure recomputes the request: failed_recving). Always asynchronous where vLLM cannot take
        # a failed synchronous load back as block ids: several KV-cache groups (it stops the engine)
        # and Model Runner V2 (vLLM 0.32 serves wrong tokens: its rollback misses the blocks,
        # reproduced with a chunk evicted before its load). Elsewhere, asynchronous above
        # sync_load_max bytes per rank: copied while the batch waits, a long hit would stall every
        # request of it (~90 ms for 32k tokens of an 8B model at the measured 45 GB/s)
        self.always_async_loads = len(groups) > 1 or bool(getattr(vllm_config, "use_v2_model_runner", False))
        self._chunk_bytes = chunk_bytes  # one chunk's KV per rank, every group (0: unknown, never too large)
        self._lookahead = drafter_lookahead(vllm_config)
        # NOTE: bounded, whatever the number of tenants (cache salts) and adapters:
        # the planners (their key caches) of the MAX_PLANNERS most recent namespaces
        self._planners: OrderedDict[tuple, Planner] = OrderedDict()
        self._maintainer_role = None
        self.activity = ActivitySummary(log, cfg.log_summary_s, _render)
        self._plans: dict[str, RequestPlan] = {}
        self._pending_loads: dict[str, RequestPlan] = {}
        self._asked: set[str] = set()
        self._promotions: dict[str, Future] = {}
        self._promoted: set[str] = set()  # promotion done: look up in memory only
        self.counters: dict[str, int] = {"lookup_errors": 0, "requests": 0, "hit_requests": 0, "delayed_frees": 0,
                                         "finished_sending": 0, "unexpected_finished_sending": 0, "event_errors": 0,
                                         "connector_resets": 0, "weights_unknown": 0, "weights_generations": 0,
                                         "block_plan_errors": 0, "weights_check_failures": 0, "adapter_unknown": 0}
        self._adapter_unknown_logged: set[int] = set()  # LoRA ids whose requests go without shmkv (said once)
        self._load_failed: set[str] = set()  # requests whose asynchronous load failed: no second hit
        # Delayed frees (worker.py): requests whose store items were shipped, then those
        # whose blocks vLLM keeps until the workers report them in finished_sending.
        self._shipped_stores: set[str] = set()
        self.delayed: set[str] = set()
        self._promoter: ThreadPoolExecutor | None = None
        kec = getattr(vllm_config, "kv_events_config", None)
        # announced to KV-cache-aware routers through vLLM's publisher (kv_events.py)
        self.events = SharedTierEvents(store, self.block_size, event_groups) \
            if kec is not None and kec.enable_kv_cache_events and stores else None
        if groups_field(self._groups):
            log.info("shmkv: hybrid KV cache, %d groups: %s", len(self._groups), "; ".join(
                f"{len(g.layer_names)} layers with " + (f"a {g.window}-token sliding window" if g.window else
                                                       f"linear-attention state ({g.state})" if g.state
                                                       else "full attention") for g in self._groups))
        if any(g.state for g in self._groups):
            log.info("shmkv: linear-attention state is restored with the attention KV: a hit ends where vLLM "
                     "kept the state at a block boundary (the end of a prefill step, block-aligned to %d tokens: "
                     "for a prompt prefilled in one step, its last whole block); the state of each such chunk "
                     "end is stored beside the chunk", self.block_size)
        sc = getattr(vllm_config, "speculative_config", None)
        if sc is not None:
            drafter = dict(self._base_ns[0].extra).get("drafter")
            log.info("shmkv: speculative decoding (%s): %s", sc.method,
                     "the drafter adds no KV; chunks are shared with engines without it" if drafter is None else
                     f"the drafter's KV layers are stored and loaded with the target's (namespace field "
                     f"drafter={drafter}); each chunk is keyed with the {self._lookahead} prompt token(s) after "
                     f"it that the drafter read" if self._lookahead else
                     f"the drafter's KV layers are stored and loaded with the target's (namespace field "
                     f"drafter={drafter})")
        self._announced = False  # the namespaces are registered and logged once final (announce_namespaces)
        self.chain = open_tiers(self.cfg, self.store, kv_element_size_bytes=self._dtype_bytes(),
                                max_chunk_bytes=max_chunk_bytes)
        if self.chain.lower:
            # NOTE: promotion reads and decompresses off the scheduler's thread
            self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shmkv-promote")
        if self.cfg.maintainer:
            from shmkv.services.maintainer import MaintainerRole

            self._maintainer_role = MaintainerRole(self.cfg, self.chain)
            self._maintainer_role.start()
        self._settle_load_failure_policy(ktc)

    def announce_namespaces(self) -> None:
        """Register the engine's namespaces (operators name them by root in
        the controller API) and log them, once they are final: after the
        workers' start reports, or at the first request if none came."""
        if self._announced or self.weights.fields() is None:
            return  # again once the weights are known (_read_weights)
        self._announced = True
        for rank, ns in enumerate(self._engine_ns()):
            # operators name a namespace by this root in the controller API (lookup, clear, pin...)
            log.info("shmkv: namespace of TP rank %d: root %s (model %s, %s, %d layers%s)", rank,
                     register(self.cfg.cache_name, ns), ns.model_id, ns.dtype, ns.num_layers,
                     ", weights generation " + self.weights.generation[:12] if self.weights.generation else "")
        if self.cfg.lossy_form:
            log.warning("shmkv: lossy_form=%s: this engine loads and stores only the %s form of chunks (made by "
                        "POST /compress with form %s; roots %s); its outputs are not those of exact KV",
                        self.cfg.lossy_form, self.cfg.lossy_form, self.cfg.lossy_form,
                        ", ".join(r.hex() for r in self._base_roots()))

    def _engine_ns(self) -> list[Namespace]:
        """The engine's namespaces (per TP rank) with its weights' fields as known now."""
        fields = self.weights.fields() or ()
        return [dataclasses.replace(n, extra=n.extra + fields) for n in self._base_ns]

    def watch_prefix_cache(self, vllm_scheduler: Any) -> None:
        """Watch vLLM's prefix cache (its block pool's hash map is a new
        object after every reset_prefix_cache(), with or without
        reset_connector): a reset is when weights updated in memory are
        expected to be seen, so it asks the workers to check them."""
        self.prefix_cache_watched = True
        pool = getattr(getattr(vllm_scheduler, "kv_cache_manager", None), "block_pool", None)
        if pool is None or not hasattr(pool, "cached_block_hash_to_block"):
            log.info("shmkv: vLLM's prefix cache cannot be watched here: weights changed in memory are seen when "
                     "the model's load_weights runs or the connector is reset")
            return
        self._block_pool = pool
        self._prefix_map = pool.cached_block_hash_to_block  # held (not its id: an address can be reused)

    def _read_weights(self) -> bool:
        """Once per step, before its first lookup or plan: read the weights'
        identity (weights.py). A change (the files' digest became known, the
        weights changed in memory) drops every planner and plan: requests
        admitted before it store nothing more (their KV may mix weights), and
        waiting ones are keyed again. False while the weights are not known
        (nothing is looked up or stored)."""
        if not self._weights_read:
            self._weights_read = True
            pool = self._block_pool
            if pool is not None and pool.cached_block_hash_to_block is not self._prefix_map:
                self._prefix_map = pool.cached_block_hash_to_block
                self.weights.ask_check()  # vLLM's prefix cache was reset: the weights may have changed
            self.weights.refresh()
            self.counters["weights_check_failures"] = self.weights.failures()
            fields = self.weights.fields()
            if fields is not None and fields != self._keyed_with:
                if self._keyed_with is not None:
                    self.counters["weights_generations"] += 1
                self._keyed_with = fields
                self._planners.clear()
                self._plans.clear()
                self._announced = False
                self.announce_namespaces()
        return self.weights.fields() is not None

    def name_sections(self, sections: dict[int, str]) -> None:
        """The workers' per-shape payload sections (a KV-cache group whose
        layers differ in shape), per TP rank, from vLLM's start handshake:
        they name the namespace, so engines whose payloads are cut otherwise
        never share keys. Before the first request (no planner is kept)."""
        self._base_ns = [dataclasses.replace(ns, extra=ns.extra + (("kv_sections", sections[rank]),))
                         if sections.get(rank) else ns for rank, ns in enumerate(self._base_ns)]
        self._planners.clear()
        self._plans.clear()

    def _settle_load_failure_policy(self, ktc) -> None:
        """A chunk evicted between lookup and load should mean "recompute it",
        never a failed request: shmkv sets vLLM's kv_load_failure_policy to
        recompute unless the user chose otherwise, on vLLM's command line or
        with shmkv's own load_failure_policy. vLLM reads it after building us."""
        explicit = explicit_load_failure_policy(sys.argv)
        if explicit is not None:
            log.info("shmkv: kv_load_failure_policy=%s as given on the command line (kept)", explicit)
            return
        if self.cfg.load_failure_policy == "recompute" and ktc.kv_load_failure_policy != "recompute":
            ktc.kv_load_failure_policy = "recompute"
            log.info("shmkv: set kv_load_failure_policy=recompute (a cache miss at load time is recomputed; to "
                     "keep vLLM's \"fail\", give it in --kv-transfer-config or set shmkv's load_failure_policy: "
                     "fail)")

    def _planner(self, salt: str | None, lora: tuple[tuple[str, str], ...] = ()) -> Planner:
        """The planner of one namespace: the engine's, with the request's cache
        salt and LoRA adapter (`lora`: namespace extra fields, lora_extra())."""
        p = self._planners.get((salt, lora))
        if p is not None:
            self._planners.move_to_end((salt, lora))
            return p
        ns = [dataclasses.replace(n.with_salt(salt), extra=n.extra + lora) for n in self._engine_ns()]
        p = Planner(ns, self.block_size, store_tail=self.cfg.store_tail, windows=[g.window for g in self._groups],
                    lossy_form=self.cfg.lossy_form or None, lookahead=self._lookahead,
                    states=[bool(g.state) for g in self._groups])
        self._planners[(salt, lora)] = p
        if len(self._planners) > MAX_PLANNERS:
            self._planners.popitem(last=False)
        return p

    def _adapter(self, request: Request) -> tuple[tuple[int, str] | None, tuple[tuple[str, str], ...]] | None:
        """The request's LoRA adapter as the workers compute with it
        (adapters.py): ((lora_int_id, digest), its namespace fields), (None,
        ()) without one, None while unknown (no lookup, no store): the digest
        every rank reports holding under the id, else (no rank holds it, or
        a load_inplace request: the workers read it at the request's first
        step) its directory's now."""
        lr = getattr(request, "lora_request", None)
        if not lr:
            return None, ()
        aid = int(lr.lora_int_id)
        # load_inplace: the workers read the files again when the request first computes
        held = None if getattr(lr, "load_inplace", False) else self.weights.adapter(aid)
        digest = held if held is not None else directory_digest(str(lr.lora_path or ""))
        if digest is None or not usable(digest):
            if aid not in self._adapter_unknown_logged:
                self._adapter_unknown_logged.add(aid)
                log.info("shmkv: LoRA adapter %r (id %d): %s; its requests are served without the shared cache "
                         "until the workers hold it as read from files they could digest", lr.lora_name, aid,
                         f"the workers hold {digest.partition(':')[0]} tensors of it" if digest else
                         f"{lr.lora_path!r} is no directory shmkv can read, and no worker holds it yet")
            return None
        return (aid, digest), (("lora_name", str(lr.lora_name)), ("lora_digest", digest))

    def _base_roots(self) -> list[bytes]:
        """The tags of the engine's own chunks (no salt, no adapter), per rank."""
        roots = [ns.root_key() for ns in self._engine_ns()]
        return [lossy_key(r, self.cfg.lossy_form) for r in roots] if self.cfg.lossy_form else roots

    def _dtype_bytes(self) -> int:
        """Bytes per element of the model's KV dtype (the byte-plane shuffle's unit; shmkv.tiers.kv_element_size)."""
        return torch.empty((), dtype=self._vllm_config.model_config.dtype).element_size()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._read_weights():
            if self.weights.pending():
                return None, False  # the workers check their weights this step: ask again next step
            self.counters["weights_unknown"] += 1
            return 0, False  # no plan: nothing of this request is stored either
        self.announce_namespaces()
        try:
            tokens = prompt_tokens(request)
            # the request's cache salt and LoRA adapter are in every key it reads or writes,
            # its multimodal items and prompt embeddings in the keys of the chunks they cover
            # (computed once per request: vLLM may ask again every step until it admits it)
            plan = self._plans.get(request.request_id)
            if plan is None or plan.prompt_len != len(tokens):
                adapter = self._adapter(request)
                if adapter is None:
                    self.counters["adapter_unknown"] += 1
                    return 0, False  # no plan: nothing of this request is stored either
                planner = self._planner(getattr(request, "cache_salt", None), adapter[1])
                extras = request_extras(request)
                plan = RequestPlan(request.request_id, len(tokens), planner.units(tokens, extras), roots=planner.roots)
                plan.extras, plan.planner, plan.request = extras, planner, request
                plan.adapter = adapter[0]
                self._plans[request.request_id] = plan
            planner = plan.planner
            plan.local_tokens = num_computed_tokens
            if not self.loads_enabled or request.request_id in self._load_failed:
                return 0, False
            first = request.request_id not in self._asked
            self._asked.add(request.request_id)
            hit, units, lower = planner.lookup(self.chain, tokens, plan.units, count=first,
                                               lower=self._look_lower(request.request_id), extras=plan.extras,
                                               tiers=plan.tiers)
            if lower:
                # Promote from disk / remote in the background; vLLM asks again next step.
                keys = [k for u in lower for k in u.keys]
                roots = [r for _ in lower for r in planner.roots]
                tokens_of = [u.tokens for u in lower for _ in u.keys]
                assert self._promoter is not None
                self._promotions[request.request_id] = self._promoter.submit(
                    self.chain.promote, keys, roots, tokens=tokens_of,
                    deadline_s=max(2.0, 4 * self.cfg.remote_timeout) if self.chain.remote is not None else None)
                log.debug("shmkv: request %s: %d tokens found on disk or remote, promoting", request.request_id,
                          sum(u.tokens for u in lower))
                self.activity.add(promotions=1, promoted_tokens=sum(u.tokens for u in lower))
                return None, False
            extra = max(0, hit - num_computed_tokens)
            extra -= extra % self.block_size  # whole blocks past vLLM's own (aligned) hit
            plan.hit_tokens = extra
            plan.hit_units = units if extra else []
            if first:
                self.counters["requests"] += 1
                self.counters["hit_requests"] += extra > 0
                log.debug("shmkv: request %s: prompt %d tokens, vLLM prefix cache %d, shmkv hit %d",
                          request.request_id, len(tokens), num_computed_tokens, extra)
                self.activity.add(requests=1, hit_requests=int(extra > 0), prompt_tokens=len(tokens),
                                  hit_tokens=extra, local_tokens=num_computed_tokens)
            plan.load_async = bool(extra) and self._load_async(extra)
            return extra, plan.load_async
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

    def hit_tokens_by_tier(self, request: Request, num_external_tokens: int) -> dict[str, int]:
        """The request's external tokens [local, local + n) by the tier each
        unit was first found in (a unit promoted from disk counts as disk)."""
        plan = self._plans.get(request.request_id)
        if plan is None:
            return {"shm": num_external_tokens}
        lo, hi = plan.local_tokens, plan.local_tokens + num_external_tokens
        out: dict[str, int] = {}
        for u in plan.hit_units:
            n = min(u.end, hi) - max(u.start, lo)
            if n > 0:
                tier = plan.tiers.get(u.start, "shm")
                out[tier] = out.get(tier, 0) + n
        rest = num_external_tokens - sum(out.values())
        if rest:
            out["shm"] = out.get("shm", 0) + rest  # never happens; vLLM wants the counts to add up
        return {t: n for t, n in out.items() if n}

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
            for tier, n in self.hit_tokens_by_tier(request, num_external_tokens).items():
                self.store.bump(_HIT_TOKENS_COUNTER[tier], n)

    def take_events(self) -> list[Any]:
        if self.events is None:
            return []
        try:
            return self.events.take_events()
        except Exception:
            self.counters["event_errors"] += 1
            log.exception("shmkv: taking the shared tier's KV events failed")
            return []

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        plan = self._plans.pop(request.request_id, None)
        if plan is not None and plan.window_skipped:
            log.debug("shmkv: request %s: %d chunks not stored (their sliding window held vLLM's null block)",
                      request.request_id, plan.window_skipped)
        self._asked.discard(request.request_id)
        self._promotions.pop(request.request_id, None)
        self._promoted.discard(request.request_id)
        self._load_failed.discard(request.request_id)
        self._pending_loads.pop(request.request_id, None)
        # Stores complete asynchronously (on every platform): keep the blocks of a
        # request with stores shipped until the workers report it in finished_sending.
        delay = request.request_id in self._shipped_stores
        self._shipped_stores.discard(request.request_id)
        if delay:
            self.delayed.add(request.request_id)
            self.counters["delayed_frees"] += 1
        return delay, None

    def update_connector_output(self, connector_output: Any) -> None:
        """Check the workers' finished_sending against the delays: vLLM asserts
        on an id it did not delay (EngineCore would die), so such an id is
        dropped here, logged and counted."""
        # NOTE: vLLM puts a request whose asynchronous load failed back to waiting and asks again;
        # its chunks may still be there (a load refused for its LoRA adapter): it is recomputed whole
        self._load_failed |= set(getattr(connector_output, "failed_recving", None) or ())
        sending = getattr(connector_output, "finished_sending", None)
        if not sending:
            return
        for req_id in list(sending):
            if req_id in self.delayed:
                self.delayed.discard(req_id)
                self.counters["finished_sending"] += 1
            else:
                sending.discard(req_id)
                self.counters["unexpected_finished_sending"] += 1
                log.error("shmkv: a worker reported request %s as finished sending, but its free was never "
                          "delayed (a bookkeeping bug); ignored", req_id)

    def reset_cache(self) -> bool:
        """vLLM's connector reset (reset_prefix_cache(reset_connector=True),
        /reset_prefix_cache?reset_external=true, pause_scheduler(clear_cache=True),
        sleep): what one engine does to itself never removes what other
        engines share. Nothing leaves any tier; the chunks this engine may use
        next are still exactly the KV it computes, because the keys name its
        weights (weights.py: a reset also asks the workers to check them).
        Clearing shared chunks is the operator's act (POST /clear, shmkv ctl
        clear). Always True: a reset never fails vLLM's sleep."""
        self.counters["connector_resets"] += 1
        self.weights.ask_check()
        log.info("shmkv: connector reset (vLLM reset_prefix_cache/pause/sleep): the shared cache is left as it is "
                 "(other engines share it; its keys name this engine's weights, which the workers now check). To "
                 "remove chunks, use the controller: POST /clear or `shmkv ctl clear`")
        return True

    def shutdown(self) -> None:
        remove_boards(self.weights.engine_id, self.weights.tp_size)
        if self._maintainer_role is not None:
            self._maintainer_role.stop()
        if self._promoter is not None:
            self._promoter.shutdown(wait=True)
        self.chain.close(flush_timeout_s=10)
