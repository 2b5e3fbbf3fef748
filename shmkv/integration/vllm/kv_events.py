"""KV events of the host-shared tier, for KV-cache-aware routers.

Owns what the scheduler half announces through vLLM's own KV-event
machinery (the connector's take_events(), published by vLLM's publisher,
ZMQ with `--kv-events-config`): a BlockStored when a chunk this engine asked
its workers to store is in the segment, and a BlockRemoved when a chunk it
announced has left it (evicted by any engine, deleted, cleared).

Each event names vLLM's own block hashes of the chunk's tokens (the request's
block_hashes, what a router matches), its token ids, parent hash and LoRA,
with medium "CPU", locality "LOCAL" and ownership "shmkv", so a router tells
a block in this engine's GPU from a chunk in the host's shared memory.

How a router should read several engines of one host: a chunk announced with
ownership "shmkv" by any engine of a host is loadable by every engine of that
host that shares its cache (same cache_name, model and settings); each engine
announces what it stored, and announces the removal of what it announced, so
a chunk stays available to the host until every engine that announced it
has announced its removal.

Invariants: an event is emitted only from facts of the segment (presence
checks), never from plans alone; the per-step work is bounded
(CHECK_KEYS_PER_STEP presence checks, a removal sweep only when the
segment's removal counter moved).
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
OWNERSHIP = "shmkv"


@dataclass
class _Chunk:
    keys: tuple[bytes, ...]  # one per TP rank
    block_hashes: list[Any]  # vLLM's ExternalBlockHash of each block of the chunk
    parent: Any
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    since: int  # the step it was planned in


class SharedTierEvents:
    """The BlockStored / BlockRemoved events of one engine's scheduler half."""

    def __init__(self, store: Store, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self._pending: list[_Chunk] = []  # store items shipped, not yet seen in the segment
        self._announced: dict[bytes, _Chunk] = {}  # by rank 0's key
        self._sweep: list[bytes] = []
        self._removal_mark = store.removal_count()
        self._step = 0
        self.counters = {"stored_events": 0, "removed_events": 0, "unseen_stores": 0}

    def stores_planned(self, request: Any, units: Iterable[Unit]) -> None:
        """Units of `request` whose store items this step ships."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        tokens = request.all_token_ids
        lora = getattr(request, "lora_request", None)
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        bs = self.block_size
        for u in units:
            first, last = u.start // bs, u.end // bs
            if last > len(hashes):
                continue  # vLLM hashed fewer blocks: nothing a router could match
            self._pending.append(_Chunk(
                keys=tuple(u.keys), block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:last]],
                parent=maybe_convert_block_hash(hashes[first - 1]) if first else None,
                token_ids=list(tokens[u.start:u.end]), lora_id=getattr(lora, "adapter_id", None),
                lora_name=getattr(lora, "name", None), since=self._step))

    def take_events(self) -> list[Any]:
        from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored

        self._step += 1
        out: list[Any] = []
        for c in self._stored_now():
            out.append(BlockStored(block_hashes=c.block_hashes, parent_block_hash=c.parent, token_ids=c.token_ids,
                                   block_size=self.block_size, lora_id=c.lora_id, medium=MEDIUM_CPU,
                                   lora_name=c.lora_name, locality="LOCAL", ownership=OWNERSHIP))
        for c in self._removed_now():
            out.append(BlockRemoved(block_hashes=c.block_hashes, medium=MEDIUM_CPU, locality="LOCAL",
                                    ownership=OWNERSHIP))
        return out

    def _stored_now(self) -> list[_Chunk]:
        if not self._pending:
            return []
        batch = self._pending[:max(1, CHECK_KEYS_PER_STEP // max(1, len(self._pending[0].keys)))]
        present = self.store.presence([k for c in batch for k in c.keys])
        done, keep, i = [], [], 0
        for c in batch:
            flags = present[i:i + len(c.keys)]
            i += len(c.keys)
            if all(p is Presence.READY for p in flags):
                if c.keys[0] not in self._announced:
                    self._announced[c.keys[0]] = c
                    done.append(c)
            elif self._step - c.since < PENDING_STEPS:
                keep.append(c)
            else:
                self.counters["unseen_stores"] += 1
        self._pending = keep + self._pending[len(batch):]
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
