"""Worker-side execution of the connector's plans: scatter loaded units into
the paged KV cache before the forward pass, gather newly computed units into
the shared segment after it.

Nothing here raises into vLLM. A unit that cannot be loaded (evicted since
the lookup, lease gone stale, an internal error) reports its blocks through
`load_errors` and vLLM recomputes them; a unit that cannot be stored (store
full, another process writing it) is skipped. Every such path has a counter.

On a GPU, stores must not stall the next forward pass: the gather runs on a
side stream and the chunk is committed when its CUDA event has completed; the
scheduler keeps the request's blocks until `finished_sending` says so. Loads
run on another side stream, one copy per chunk and layer in forward order,
with one CUDA event per layer: wait_layer makes the compute stream wait on
its layer's event (the host never waits), and the leases are released once
the last event has completed.

A hybrid model's KV cache is several groups (one KVLayout each, with its own
block ids); a unit's payload is the groups' sections in group order, each
`[layers of the group][its stored blocks][block bytes]` (or per token).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from shmkv.activity import ActivitySummary
from shmkv.errors import InvalidArgumentError
from shmkv.integration.vllm.planner import GroupWindow, LoadItem, StoreItem
from shmkv.layout import KVLayout
from shmkv.store import PutResult, Reservation, Store
from shmkv.tiers import decoded

log = logging.getLogger("shmkv.connector")


def _avoid_cores_of_the_main_thread() -> None:
    """Move the calling thread to the CPUs its creator is not bound to: vLLM
    binds the worker's OpenMP threads (and so the threads it starts) to its
    compute cores; a copy thread there would only steal from the forward."""
    try:
        mine = os.sched_getaffinity(0)
        others = set(range(os.cpu_count() or 1)) - mine
        if others:
            os.sched_setaffinity(0, others)
    except OSError:
        pass


@dataclass
class _PendingStore:
    req_id: str
    reservation: Reservation
    event: Any
    namespace: bytes | None = None
    tokens: int = 0


@dataclass
class RequestTally:
    stored_tokens: int = 0
    stored_units: int = 0
    already_cached: int = 0
    not_stored: int = 0
    store_s: float = 0.0
    t_first: float = field(default_factory=time.perf_counter)


class LoadBatch:
    """One step's loads: the leased units, which layers are in place, what failed."""

    def __init__(self, items: list[LoadItem], positions: dict[str, int]) -> None:
        self.t0 = time.perf_counter()
        self.by_request: dict[str, list[LoadItem]] = defaultdict(list)
        for it in items:
            self.by_request[it.req_id].append(it)
        self.jobs: list[tuple[LoadItem, Any]] = []  # (item, its lease)
        self.failed: set[int] = set()  # block ids vLLM must recompute
        self.broken: set[int] = set()  # job indices whose copy failed
        self.sources: dict[int, Any] = {}  # job index -> decoded payload (compressed entries)
        self.plans: dict[int, list] = {}  # job index -> its copies (KVWorker._scatter_plan), made once
        self._positions = positions  # layer name -> forward position
        self.layer_done = [threading.Event() for _ in range(len(positions))]
        self.loader: threading.Thread | None = None
        self.cuda_events: list[Any] = []  # GPU: per forward position, recorded on the load stream
        self.device: Any = None

    def wait_layer(self, name: str) -> None:
        """Until this layer's loads are in place: on the CPU the caller blocks
        (only when pipelined); on a GPU the compute stream waits on the device."""
        idx = self._positions.get(name)
        if idx is None:
            return
        if self.cuda_events:
            import torch

            torch.cuda.current_stream(self.device).wait_event(self.cuda_events[idx])
        elif self.loader is not None:
            self.layer_done[idx].wait()


class KVWorker:
    """Loads and stores units for one worker (one TP rank)."""

    def __init__(self, store: Store, layouts: KVLayout | Sequence[KVLayout], tp_rank: int, *,
                 digest_file: str = "", remote=None, layer_order: Sequence[str] | None = None,
                 lossy_ok: bool = False):
        """`layouts`: one per KV-cache group, in vLLM's group order;
        `layer_order`: every layer name in forward order (default: group by group);
        `lossy_ok`: the engine opted in to lossy KV (lossy_form), else a lossy
        chunk is never loaded."""
        self.cache = store
        self.remote = remote  # write-through: committed chunks are queued for the remote tier
        self.layouts = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        self.layout = layout = self.layouts[0]
        if len({lay.block_size for lay in self.layouts}) != 1:
            raise ValueError("every KV-cache group must have the same block size")
        where = {name: (g, li) for g, lay in enumerate(self.layouts) for li, name in enumerate(lay.names)}
        order = list(layer_order) if layer_order is not None else list(where)
        if sorted(order) != sorted(where):
            raise ValueError("layer_order must name every layer of the groups once")
        self._order = [where[name] for name in order]  # forward position -> (group, layer in group)
        self._position = {name: i for i, name in enumerate(order)}
        self.rank = tp_rank
        self.counters: Counter[str] = Counter()
        self.tallies: dict[str, RequestTally] = defaultdict(RequestTally)
        self.digest_file = digest_file
        self.lossy_ok = lossy_ok
        self.on_gpu = layout.on_gpu  # the copy backend chosen with the layout
        self._pending: list[_PendingStore] = []
        self._side_stream = None
        self._load_stream = None
        if self.on_gpu:
            import torch

            from shmkv import gpu

            gpu.register_segment(store)
            self._side_stream = torch.cuda.Stream(layout.device)
            self._load_stream = torch.cuda.Stream(layout.device)

    # ------------------------------------------------------------ loads --
    # A step's loads are one LoadBatch, pipelined with the forward pass on the
    # CPU: a helper thread (moved off the cores vLLM's OpenMP pool is bound
    # to) scatters the units layer by layer, and batch.wait_layer(name) blocks
    # only until that layer is in place. finish_load(batch) joins, releases
    # the leases and reports.
    def load(self, items: list[LoadItem]) -> tuple[set[int], dict[str, tuple[int, float]]]:
        """Scatter every item now; returns (block ids that failed, per request
        (tokens loaded, seconds))."""
        return self.finish_load(self.start_load(items, pipelined=False))

    def start_load(self, items: list[LoadItem], *, pipelined: bool = True) -> LoadBatch:
        batch = LoadBatch(items, self._position)
        for req_id, its in batch.by_request.items():
            try:
                leases = self.cache.acquire_prefix([it.keys[self.rank] for it in its], count_lookup=False)
            except Exception:
                log.exception("shmkv: lookup for loading request %s failed; vLLM recomputes it", req_id)
                self.counters["load_errors"] += 1
                leases = []
            for i, it in enumerate(its):
                if i < len(leases):
                    batch.jobs.append((it, leases[i]))
                else:
                    batch.failed.update(it.block_ids)
                    self.counters["load_missing_units"] += 1
        if pipelined and not self.on_gpu and len(self._order) > 1 and batch.jobs:
            batch.loader = threading.Thread(target=self._load_layers, args=(batch, True), name="shmkv-load",
                                            daemon=True)
            batch.loader.start()
        else:
            self._load_layers(batch, False)
        return batch

    def _decode_compressed(self, batch: LoadBatch) -> None:
        """Decode the compressed entries of the batch (POST /compress) into
        host buffers the copies read from; a damaged one is recomputed."""
        for j, (it, lease) in enumerate(batch.jobs):
            if not lease.compressed:
                continue
            raw = decoded(lease, it.keys[self.rank], lossy_ok=self.lossy_ok)
            if raw is None:
                log.warning("shmkv: a compressed chunk of request %s is damaged%s; vLLM recomputes it", it.req_id,
                            "" if self.lossy_ok else " (or lossy)")
                batch.broken.add(j)
                self.counters["load_damaged"] += 1
                continue
            if self.on_gpu:
                import torch

                # NOTE: pinned, so the copy kernels read it through unified addressing
                # (untested on a GPU so far).
                batch.sources[j] = torch.frombuffer(raw, dtype=torch.uint8).pin_memory()
            else:
                batch.sources[j] = raw
            self.counters["load_decoded"] += 1

    def _load_layers(self, batch: LoadBatch, move_off_omp_cores: bool) -> None:
        if move_off_omp_cores:
            _avoid_cores_of_the_main_thread()
        self._decode_compressed(batch)
        if self.on_gpu:
            self._load_all_layers(batch)
            return
        for pos, (g, layer) in enumerate(self._order):
            self._load_layer(batch, g, layer)
            batch.layer_done[pos].set()

    def _load_layer(self, batch: LoadBatch, group: int, layer: int) -> None:
        """One layer of every unit of the batch; a unit whose copy fails is
        broken (its blocks recomputed), the others go on."""
        for j, (it, lease) in enumerate(batch.jobs):
            if j in batch.broken:
                continue
            try:
                plan = batch.plans.get(j)
                if plan is None:
                    plan = batch.plans[j] = self._scatter_plan(it)
                self._scatter(it, batch.sources.get(j, lease), group, (layer, layer + 1), plan)
            except Exception:
                log.exception("shmkv: loading a chunk of request %s failed; vLLM recomputes it", it.req_id)
                batch.broken.add(j)
                self.counters["load_errors"] += 1

    def _load_all_layers(self, batch: LoadBatch) -> None:
        """GPU: on the load stream, layer by layer in forward order, one
        scatter per unit and layer, then that layer's event (nothing waits here)."""
        import torch

        device = self.layout.device
        stream = self._load_stream
        # NOTE: the blocks being filled may still be read by work queued before on the compute stream
        stream.wait_stream(torch.cuda.current_stream(device))
        events = []
        with torch.cuda.stream(stream):
            for g, layer in self._order:
                self._load_layer(batch, g, layer)
                ev = torch.cuda.Event()
                ev.record(stream)
                events.append(ev)
        batch.device = device
        batch.cuda_events = events if batch.jobs else []
        for done in batch.layer_done:
            done.set()

    def finish_load(self, batch: LoadBatch) -> tuple[set[int], dict[str, tuple[int, float]]]:
        """Wait for the batch, release its leases; (block ids that failed, per
        request (tokens loaded, seconds))."""
        if batch.loader is not None:
            batch.loader.join()
            batch.loader = None
        if batch.cuda_events:
            # NOTE: the leases (and decoded sources) are released only once every copy is done;
            # by now the forward pass has waited on every layer, so this rarely waits
            batch.cuda_events[-1].synchronize()
            batch.cuda_events = []
        bs = self.layout.block_size
        loaded: dict[str, int] = defaultdict(int)
        for j, (it, lease) in enumerate(batch.jobs):
            ok = j not in batch.broken
            if ok and self.digest_file:
                self._digest_load(it)
            if not lease.release():  # reclaimed meanwhile: the bytes may be wrong
                self.counters["load_stale"] += 1
                ok = False
            if ok:
                loaded[it.req_id] += max(len(w.block_ids) for w in it.groups) * bs
            else:
                batch.failed.update(it.block_ids)
        seconds = time.perf_counter() - batch.t0
        self.counters["loaded_tokens"] += sum(loaded.values())
        batch.jobs = []
        batch.sources = {}
        batch.plans = {}
        return batch.failed, {r: (loaded[r], seconds) for r in batch.by_request}

    def _sections(self, groups: Sequence[GroupWindow]) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each group's section of a unit's payload."""
        out, off = [], 0
        for lay, w in zip(self.layouts, groups):
            n = lay.payload_bytes(w.payload_blocks * lay.block_size)
            out.append((off, n))
            off += n
        return out

    def _scatter_plan(self, it: LoadItem) -> list[tuple[int, KVLayout, Any, dict[str, Any]]]:
        """(group, layout, index, copy options) of each group the item fills:
        computed once per item, then used for every layer."""
        import numpy as np

        sections = self._sections(it.groups)
        plan = []
        for g, (lay, w) in enumerate(zip(self.layouts, it.groups)):
            if not w.block_ids:
                continue  # nothing of this group is needed (outside its sliding window)
            if lay.token_mode:
                plan.append((g, lay, self._window_slots(lay, w), {"part": sections[g]}))
            else:
                plan.append((g, lay, np.asarray(w.block_ids, dtype=np.int64),
                             {"payload_first": w.payload_first, "payload_blocks": w.payload_blocks,
                              "part": sections[g]}))
        return plan

    def _scatter(self, it: LoadItem, lease: Any, group: int | None = None,
                 layers: tuple[int, int] | None = None, plan: list | None = None) -> None:
        """Copy the item's window of one group (all groups when None) into the paged cache."""
        for g, lay, index, options in self._scatter_plan(it) if plan is None else plan:
            if group is None or g == group:
                lay.scatter(index, lease, layers=layers, **options)

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
    def store(self, items: Iterable[StoreItem]) -> None:
        for it in items:
            t0 = time.perf_counter()
            tally = self.tallies[it.req_id]
            key = it.keys[self.rank]
            try:
                nbytes = sum(n for _, n in self._sections(it.groups))
                ns = it.namespaces[self.rank] if it.namespaces else None
                r = self.cache.reserve(key, nbytes, namespace=ns, tokens=it.tokens)
                if isinstance(r, PutResult):
                    if r in (PutResult.EXISTS, PutResult.BUSY):
                        tally.already_cached += 1
                    else:
                        tally.not_stored += 1
                    self.counters[f"store_{r.name.lower()}"] += 1
                    continue
                if self.on_gpu:
                    self._store_async(it, r, ns)
                else:
                    self._gather_into(it, r)
                    if self.digest_file:
                        self._digest_store(it, r)
                    if r.commit() is not PutResult.OK:
                        tally.not_stored += 1
                        self.counters["store_stale"] += 1
                        continue
                    self._committed(key, ns, it.tokens)
                tally.stored_units += 1
                tally.stored_tokens += it.tokens
                self.counters["stored_units"] += 1
                self.counters["stored_tokens"] += it.tokens
            except Exception:
                log.exception("shmkv: storing a chunk of request %s failed; continuing without it", it.req_id)
                self.counters["store_errors"] += 1
                tally.not_stored += 1
            finally:
                tally.store_s += time.perf_counter() - t0

    def _gather_into(self, it: StoreItem, r: Reservation, stream: Any = None) -> None:
        """Every group's window into its section of the reservation (aborted on failure)."""
        try:
            for lay, w, part in zip(self.layouts, it.groups, self._sections(it.groups)):
                if lay.token_mode:
                    lay.gather(self._window_slots(lay, w), r, stream=stream, part=part)
                else:
                    lay.gather(list(w.block_ids), r, part=part)
        except BaseException:
            r.abort()
            raise

    def _committed(self, key: bytes, ns: bytes | None, tokens: int) -> None:
        if self.remote is not None and ns is not None:
            self.remote.enqueue(key, ns, tokens)

    def _store_async(self, it: StoreItem, r: Reservation, ns: bytes | None) -> None:
        import torch

        # NOTE: the side stream must see the KV the forward pass just wrote.
        self._side_stream.wait_stream(torch.cuda.current_stream(self.layout.device))
        with torch.cuda.stream(self._side_stream):
            self._gather_into(it, r, stream=self._side_stream)
            ev = torch.cuda.Event()
            ev.record(self._side_stream)
        self._pending.append(_PendingStore(it.req_id, r, ev, ns, it.tokens))

    def poll(self) -> None:
        """Commit GPU stores whose copies have completed."""
        still = []
        for p in self._pending:
            if p.event.query():
                if p.reservation.commit() is not PutResult.OK:
                    self.counters["store_stale"] += 1
                else:
                    self._committed(p.reservation.key, p.namespace, p.tokens)
            else:
                still.append(p)
        self._pending = still

    def order_compute_after_stores(self) -> None:
        """Make the compute stream wait (on the device, not the host) until
        every pending store has read its blocks."""
        import torch

        stream = torch.cuda.current_stream(self.layout.device)
        for p in self._pending:
            stream.wait_event(p.event)

    def pending_requests(self) -> set[str]:
        return {p.req_id for p in self._pending}

    def finish(self, req_id: str) -> RequestTally | None:
        return self.tallies.pop(req_id, None)

    def shutdown(self) -> None:
        for p in self._pending:
            p.event.synchronize()
        self.poll()
        if self.remote is not None:
            self.remote.flush(timeout_s=10)
            self.remote.close()

    # ------------------------------------------------------------ debug --
    # Lines "store KEY GROUP DIGEST" (a group's section as stored) and "load
    # KEY GROUP FIRST N TOTAL DIGEST" (the paged cache's bytes of the blocks a
    # load filled, re-gathered): a load with FIRST 0 and N == TOTAL must
    # digest like the stored section.
    def _digest_load(self, it: LoadItem) -> None:
        import torch

        lines = []
        for g, (lay, w) in enumerate(zip(self.layouts, it.groups)):
            n = len(w.block_ids)
            if not n:
                continue
            tokens = n * lay.block_size
            buf = torch.empty(lay.payload_bytes(tokens), dtype=torch.uint8)
            index = lay.slots_for_blocks(list(w.block_ids), tokens) if lay.token_mode else list(w.block_ids)
            lay.gather(index, buf)
            lines.append(f"load {it.keys[self.rank].hex()} {g} {w.payload_first} {n} {w.payload_blocks} "
                         f"{xxhash.xxh3_128_hexdigest(buf.numpy())}\n")
        with open(self.digest_file, "a") as f:
            f.writelines(lines)

    def _digest_store(self, it: StoreItem, r: Reservation) -> None:
        mv = r.view()
        with open(self.digest_file, "a") as f:
            for g, (off, n) in enumerate(self._sections(it.groups)):
                f.write(f"store {r.key.hex()} {g} {xxhash.xxh3_128_hexdigest(mv[off:off + n])}\n")


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


class WorkerSide:
    """The connector's worker half (one vLLM worker process, one TP rank): it
    builds the copy layouts when vLLM registers its KV caches, runs each
    step's loads (before the forward pass) and stores (after it), and tells
    vLLM which blocks it must recompute. Free of vLLM imports: it sees vLLM's
    tensors and the scheduler half's ShmKVMetadata only."""

    def __init__(self, cfg: Any, store: Store, groups: Sequence[Any], tp_rank: int, block_size: int) -> None:
        self.cfg = cfg
        self.store = store
        self.groups = list(groups)  # engine_inputs.KVGroup per KV-cache group
        self.tp_rank = tp_rank
        self.block_size = block_size  # of vLLM's block tables
        self.worker: KVWorker | None = None
        self.off_reason: str | None = None  # the KV caches could not be copied: every load is recomputed
        self.activity = ActivitySummary(log, cfg.log_summary_s, _render)
        self._transfer = _new_transfer_stats()  # since vLLM last asked (get_kv_connector_stats)
        self._load_errors: set[int] = set()  # blocks vLLM must recompute
        self._finished_waiting: set[str] = set()
        self._loading: tuple[Any, LoadBatch] | None = None  # this step's metadata and loads

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        first = next(iter(kv_caches.values()))
        # vLLM 0.32 views every layer's cache as [blocks, heads, block tokens, content]
        # (vllm/v1/kv_cache_interface.py create_kv_cache_views), in the physical order
        # of the engine's KVCacheLayout: the strides say which. On the CPU backend the
        # content of a block is ISA-packed: whole blocks are copied.
        kind = "cpu" if first.device.type == "cpu" else "hnd"
        groups = [g.layer_names or tuple(kv_caches) for g in self.groups]
        try:
            if first.dim() != 4:
                raise InvalidArgumentError(f"a {first.dim()}-D KV cache tensor of shape {tuple(first.shape)} "
                                           "(vLLM 0.32 gives [blocks, heads, block tokens, content])")
            layouts = [KVLayout(kind, [kv_caches[n] for n in names], names, block_size=self.block_size)
                       for names in groups]
        except InvalidArgumentError as e:
            self.off_reason = str(e)
            log.error("shmkv: cannot copy this engine's KV cache (%s); the connector stores nothing and every "
                      "hit is recomputed by vLLM", e)
            return
        if first.device.type == "cuda":
            for lay in layouts:
                lay.copier.engines(store=self.cfg.cuda_store_copy, load=self.cfg.cuda_load_copy)
        remote = None
        if self.cfg.remote_write_through:
            from shmkv.remote import open_remote

            remote = open_remote(self.cfg, store=self.store, disk=None,
                                 element_size=self.cfg.disk_shuffle_bytes or first.element_size())
        self.worker = KVWorker(self.store, layouts, self.tp_rank, digest_file=self.cfg.debug_digest_file,
                               remote=remote, layer_order=list(kv_caches), lossy_ok=bool(self.cfg.lossy_form))
        log.info("shmkv: registered %d KV layers in %d group(s) (%s layout, %s, %.1f KiB per token)",
                 len(kv_caches), len(layouts), kind, str(first.dtype).replace("torch.", ""),
                 sum(lay.bytes_per_token() for lay in layouts) / 1024)

    def bind(self, meta: Any) -> None:
        """A step's metadata arrives (before any load)."""
        if getattr(meta, "failed_blocks", None):
            self._load_errors |= meta.failed_blocks
        if self.worker is not None and self.worker.on_gpu and any(g.window for g in self.groups):
            # NOTE: vLLM frees sliding-window blocks as a request advances and may hand them
            # to this step's forward: it must not overwrite them before last step's stores
            # have read them (the compute stream waits on their events; the host does not).
            self.worker.order_compute_after_stores()

    def start_load(self, meta: Any) -> None:
        if self.worker is None and self.off_reason is not None:
            for it in getattr(meta, "loads", ()):
                self._load_errors.update(it.block_ids)  # never run on blocks nobody filled
            return
        if self.worker is None or not getattr(meta, "loads", None):
            return
        self._loading = meta, self.worker.start_load(meta.loads)

    def wait_layer(self, layer_name: str) -> None:
        if self._loading is not None:
            self._loading[1].wait_layer(layer_name)

    def _finish_load(self) -> None:
        if self._loading is None or self.worker is None:
            return
        (meta, batch), self._loading = self._loading, None
        failed, done = self.worker.finish_load(batch)
        self._load_errors |= failed
        seconds = max((sec for _, sec in done.values()), default=0.0)
        loaded = sum(t for t, _ in done.values())
        self.activity.add(loaded_tokens=loaded, load_ms=seconds * 1e3, load_failed_blocks=len(failed))
        _count(self._transfer, loaded_tokens=loaded, load_failed_blocks=len(failed))
        self._transfer["observations"].setdefault("load_seconds", []).append(seconds)
        for req_id, (tokens, seconds) in done.items():
            s = meta.summaries.get(req_id)
            log.debug("shmkv: request %s: prompt %d tokens, hit %d (vLLM prefix cache %d), loaded %d in %.1f ms%s",
                     req_id, s.prompt_tokens if s else -1, (s.local_tokens + s.hit_tokens) if s else -1,
                     s.local_tokens if s else -1, tokens, seconds * 1e3,
                     f", {len(failed)} blocks to recompute" if failed else "")

    def wait_for_save(self, meta: Any) -> None:
        self._finish_load()  # the forward pass is over: release this step's leases
        if self.worker is None:
            return
        if getattr(meta, "stores", None):
            before = self.worker.counters["stored_tokens"]
            t0 = time.perf_counter()
            self.worker.store(meta.stores)
            _count(self._transfer, stored_tokens=self.worker.counters["stored_tokens"] - before)
            self._transfer["observations"].setdefault("store_seconds", []).append(time.perf_counter() - t0)
        self.worker.poll()

    def take_transfer_stats(self) -> dict[str, Any] | None:
        """What this worker moved since the last call ({"counters", "observations"}), or None."""
        out, self._transfer = self._transfer, _new_transfer_stats()
        return out if out["counters"] or any(out["observations"].values()) else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        self.worker.poll()
        for req_id in finished_req_ids:
            t = self.worker.finish(req_id)
            if t and (t.stored_units or t.already_cached or t.not_stored):
                log.debug("shmkv: request %s: stored %d tokens in %d chunks (%.1f ms); %d already cached, %d not "
                          "stored", req_id, t.stored_tokens, t.stored_units, t.store_s * 1e3, t.already_cached,
                          t.not_stored)
                self.activity.add(stored_tokens=t.stored_tokens, stored_chunks=t.stored_units,
                                  store_ms=t.store_s * 1e3, already_cached=t.already_cached, not_stored=t.not_stored)
        if not self.worker.on_gpu:
            return None, None
        self._finished_waiting |= finished_req_ids
        pending = self.worker.pending_requests()
        done = {r for r in self._finished_waiting if r not in pending}
        self._finished_waiting -= done
        return (done or None), None

    def load_errors(self) -> set[int]:
        """Blocks vLLM must recompute (and forget them)."""
        self._finish_load()
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        self._finish_load()
        if self.worker is not None:
            self.worker.shutdown()
