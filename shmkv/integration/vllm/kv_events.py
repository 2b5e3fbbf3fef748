"""KV events of the host-shared tier, for KV-cache-aware routers.

Owns what the scheduler half announces through vLLM's own KV-event
machinery (the connector's take_events(), published by vLLM's publisher,
ZMQ with `--kv-events-config`): a BlockStored when a chunk this engine asked
its workers to store is in the segment, and a BlockRemoved when a chunk it
announced has left it (evicted by any engine, deleted, cleared).

Each event names vLLM's own block hashes of the chunk's tokens (the request's
block_hashes, what a router matches), its token ids, parent hash, LoRA,
extra keys (multimodal items, cache salt, prompt embeddings, as vLLM
publishes them) and session, with medium "CPU", locality "LOCAL" and
ownership "shmkv", so a router tells a block in this engine's GPU from a
chunk in the host's shared memory. A hybrid model's chunk is one event per
KV-cache group (`group_idx`, `kv_cache_spec_kind`, its sliding window), each
naming the blocks that group holds of it: all of them for full attention,
the window's for a sliding group, and for a linear-attention group the block
whose state the chunk's state entry holds, once that entry is stored.

How a router should read several engines of one host: a chunk announced with
ownership "shmkv" by any engine of a host is loadable by every engine of that
host that shares its cache (same cache_name, model and settings); each engine
announces what it stored, and announces the removal of what it announced, so
a chunk stays available to the host until every engine that announced it
has announced its removal.

Invariants: an event is emitted only from facts of the segment (presence
checks), never from plans alone; the per-step work is bounded
(CHECK_KEYS_PER_STEP presence checks, a removal sweep only when the
segment's removal counter moved); so is what waits: at most MAX_PENDING
chunks (the oldest dropped first, counted). Nothing blocks the head: each
step checks the chunks planned in the last RECENT_STEPS steps first (a store
that lands is announced within a step or two whatever else waits), then a
window of the older ones that moves on every step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from shmkv.chunking import Unit
from shmkv.store import Presence, Store

log = logging.getLogger("shmkv.connector")

CHECK_KEYS_PER_STEP = 1024  # keys whose presence one take_events() call may check
PENDING_STEPS = 10_000  # steps after which a chunk never seen in the segment stops being watched
MAX_PENDING = 4096  # chunks watched at most (each store ships at most its step's chunks)
RECENT_STEPS = 2  # chunks planned this recently are checked before any older one
OWNERSHIP = "shmkv"


@dataclass(frozen=True)
class EventGroup:
    """What a KV-cache group's events say of it (vLLM's KVCacheSpecKind value, its window)."""

    kind: str = "full_attention"
    sliding_window: int | None = None


def event_groups_of(kv_cache_config: Any) -> list[EventGroup]:
    """One EventGroup per KV-cache group of the engine, as vLLM's offloading tier names them."""
    if kv_cache_config is None:
        return [EventGroup()]
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    return [EventGroup(get_kv_cache_spec_kind(g.kv_cache_spec).value,
                       get_kv_cache_spec_sliding_window(g.kv_cache_spec)) for g in kv_cache_config.kv_cache_groups]


@dataclass
class _Part:
    """One group's blocks of a chunk (one BlockStored / BlockRemoved)."""

    group: int
    block_hashes: list[Any]  # vLLM's ExternalBlockHash of each block
    parent: Any
    token_ids: list[int]
    extra_keys: list[Any] | None


@dataclass
class _Chunk:
    keys: tuple[bytes, ...]  # one per TP rank
    parts: list[_Part]
    lora_id: int | None
    lora_name: str | None
    session_id: str | None
    since: int  # the step it was planned in


class SharedTierEvents:
    """The BlockStored / BlockRemoved events of one engine's scheduler half."""

    def __init__(self, store: Store, block_size: int, groups: list[EventGroup] | None = None) -> None:
        self.store = store
        self.block_size = block_size
        self.groups = list(groups) if groups else [EventGroup()]
        self._pending: list[_Chunk] = []  # store items shipped, not yet seen in the segment
        self._announced: dict[bytes, _Chunk] = {}  # by rank 0's key
        self._sweep: list[bytes] = []
        self._removal_mark = store.removal_count()
        self._step = 0
        self._cursor = 0  # where the window over older pending chunks starts next
        self.counters = {"stored_events": 0, "removed_events": 0, "unseen_stores": 0, "pending_dropped": 0}

    def stores_planned(self, request: Any, units: Iterable[tuple[Unit, list[tuple[int, int, int]]]]) -> None:
        """Units of `request` whose store items this step ships, each with
        the blocks it holds per group: (group, first block of the prompt, blocks)."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        tokens = request.all_token_ids
        lora = getattr(request, "lora_request", None)
        from vllm.v1.core.kv_cache_utils import (
            generate_block_hash_extra_keys,
            maybe_convert_block_hash,
            to_event_extra_keys,
        )

        bs = self.block_size
        for u, blocks in units:
            parts = []
            for g, first, n in blocks:
                if not n or first + n > len(hashes):
                    continue  # vLLM hashed fewer blocks: nothing a router could match
                extra = [generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, 0)[0]
                         for b in range(first, first + n)]
                parts.append(_Part(g, [maybe_convert_block_hash(h) for h in hashes[first:first + n]],
                                   maybe_convert_block_hash(hashes[first - 1]) if first else None,
                                   list(tokens[first * bs:(first + n) * bs]),
                                   to_event_extra_keys(extra)))  # per block, None entries too (as vLLM)
            if parts:
                self._pending.append(_Chunk(keys=tuple(u.keys), parts=parts, lora_id=getattr(lora, "adapter_id", None),
                                            lora_name=getattr(lora, "name", None),
                                            session_id=getattr(request, "session_id", None), since=self._step))
        if len(self._pending) > MAX_PENDING:  # the oldest have had the longest to land
            over = len(self._pending) - MAX_PENDING
            del self._pending[:over]
            self.counters["pending_dropped"] += over

    def take_events(self) -> list[Any]:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

        self._step += 1
        out: list[Any] = []
        for c in self._stored_now():
            for p in c.parts:
                grp = self.groups[p.group] if p.group < len(self.groups) else EventGroup("unknown")
                out.append(BlockStored(block_hashes=p.block_hashes, parent_block_hash=p.parent, token_ids=p.token_ids,
                                       block_size=self.block_size, lora_id=c.lora_id, medium=MEDIUM_CPU,
                                       lora_name=c.lora_name, extra_keys=p.extra_keys, group_idx=p.group,
                                       kv_cache_spec_kind=grp.kind, kv_cache_spec_sliding_window=grp.sliding_window,
                                       locality="LOCAL", ownership=OWNERSHIP, session_id=c.session_id))
        for c in self._removed_now():
            for p in c.parts:
                out.append(BlockRemoved(block_hashes=p.block_hashes, medium=MEDIUM_CPU,
                                        group_idx=p.group, locality="LOCAL", ownership=OWNERSHIP))
        return out

    def _batch(self) -> list[int]:
        """Indices into _pending to check this step: the recent chunks first,
        then a window over the older ones that moves on each step."""
        n = len(self._pending)
        room = max(1, CHECK_KEYS_PER_STEP // max(1, len(self._pending[0].keys)))
        if n <= room:
            return list(range(n))
        older = n
        while older > 0 and self._step - self._pending[older - 1].since <= RECENT_STEPS:
            older -= 1
        recent = list(range(max(older, n - room), n))
        take = min(older, room - len(recent))
        start = self._cursor % older if older else 0
        window = [(start + j) % older for j in range(take)]
        self._cursor = start + take
        return sorted(set(window) | set(recent))

    def _stored_now(self) -> list[_Chunk]:
        if not self._pending:
            return []
        idx = self._batch()
        batch = [self._pending[j] for j in idx]
        present = self.store.presence([k for c in batch for k in c.keys])
        done, drop, i = [], set(), 0
        for j, c in zip(idx, batch):
            flags = present[i:i + len(c.keys)]
            i += len(c.keys)
            if all(p is Presence.READY for p in flags):
                drop.add(j)
                if c.keys[0] not in self._announced:
                    self._announced[c.keys[0]] = c
                    done.append(c)
            elif self._step - c.since >= PENDING_STEPS:
                drop.add(j)
                self.counters["unseen_stores"] += 1
        if drop:
            self._pending = [c for j, c in enumerate(self._pending) if j not in drop]
        self.counters["stored_events"] += len(done)
        return done

    def _removed_now(self) -> list[_Chunk]:
        if not self._sweep:
            if not self._announced:
                return []
            now = self.store.removal_count()
            if now == self._removal_mark:
                return []
            self._removal_mark = now
            self._sweep = list(self._announced)
        batch, self._sweep = self._sweep[:CHECK_KEYS_PER_STEP], self._sweep[CHECK_KEYS_PER_STEP:]
        present = self.store.presence(batch)
        gone = [self._announced.pop(k) for k, p in zip(batch, present) if p is Presence.ABSENT and k in self._announced]
        self.counters["removed_events"] += len(gone)
        return gone
