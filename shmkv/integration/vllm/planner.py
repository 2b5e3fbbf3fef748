"""Scheduler-side planning of the vLLM connector, free of vLLM types: request
and block bookkeeping over the engine-neutral core (prompts are cut into
units by shmkv.chunking, with vLLM's block size as the tail piece's
granularity when `store_tail`; the tier chain, shmkv.tiers, finds what is
cached).

The planner answers three questions:
  * lookup: how many prompt tokens can shmkv supply (the chain's prefix
    walk, capped by vLLM's rules), never the whole prompt;
  * load plan: which stored unit fills which of the request's blocks, as a
    window of the unit's payload (vLLM's own prefix hit may end mid-chunk);
  * store plan: which units became fully computed this step and are not
    cached yet (chunked prefill stores chunk by chunk; decode is ignored).

Hybrid models (vLLM's hybrid KV-cache manager): the KV cache is split into
*groups* of layers, each with its own block table (`RequestPlan.block_ids`
holds one list per group). A unit's payload is the groups' parts one after
the other. A full-attention group stores all the unit's blocks. A
sliding-window group (window W) stores only the blocks holding the unit's
last W-1 tokens, [max(start, end - W + 1), end): the only ones a hit ending
at or after the unit's end can need (vLLM frees, and pads with its null
block, everything before the window of the next token). Those blocks are
always still allocated in the step that completes the unit; a unit whose
window holds a null block (vLLM's own prefix hit skipped it) is not stored.
A load fills a sliding group only from the window of the hit's end on; a hit
that ends inside its last unit (vLLM's one-token rule) is cut back to the
unit's start when that unit's stored window does not cover it.

Linear-attention groups (Mamba, gated delta net; vLLM's align mode) hold a
recurrent state, not per-token KV: a unit's payload has no part of them.
The state after a unit's last token is its own entry (Unit.state_unit,
keyed by shmkv.keys.state_key), stored from the exact block vLLM hands over
for that boundary (store_state_items) and loaded into the block vLLM
allocates for the state at the hit's end. A hit always ends where a state
is held: attention KV is never loaded without the state that goes with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shmkv.chunking import Chunker, Unit
from shmkv.keys import ExtraInputs, Namespace
from shmkv.names import SHM
from shmkv.tiers import TierChain
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

NULL_BLOCK = 0  # vLLM's null block (the block pool's first): a freed or skipped position
ALL_BLOCKS = -1  # in a step's reused_blocks: any block (the scheduler half could not tell which)


@dataclass
class RequestPlan:
    """What the scheduler half remembers about one live request."""

    req_id: str
    prompt_len: int
    units: list[Unit]
    hit_tokens: int = 0  # tokens shmkv supplies (beyond vLLM's local hit)
    local_tokens: int = 0  # vLLM's own prefix-cache hit when it asked us
    hit_units: list[Unit] = field(default_factory=list)  # what the lookup found
    block_ids: list[list[int]] = field(default_factory=lambda: [[]])  # per KV-cache group
    next_store: int = 0  # first unit not yet considered for storing
    window_skipped: int = 0  # units not stored: a sliding window held vLLM's null block
    roots: tuple[bytes, ...] = ()  # namespace root key per rank (the request's cache salt included)
    extras: ExtraInputs | None = None  # multimodal items / prompt embeddings (in the keys of the chunks they cover)
    tiers: dict[int, str] = field(default_factory=dict)  # unit start -> the tier it was first found in
    planner: Planner | None = None  # of the request's namespace (its salt and LoRA adapter)
    request: Any = None  # vLLM's Request (its block hashes name the chunks in KV events)
    scheduled_tokens: int = 0  # in the step that loads the hit (where the running recurrent state goes)
    load_async: bool = False  # its hit loads asynchronously (vLLM's WAITING_FOR_REMOTE_KVS)
    adapter: tuple[int, str] | None = None  # its LoRA adapter: (lora_int_id, digest its keys name; adapters.py)


class Planner:
    def __init__(self, namespaces: Sequence[Namespace | bytes], block_size: int, *, store_tail: bool = True,
                 chunk_size: int | None = None, windows: Sequence[int] = (0,), lossy_form: str | None = None,
                 lookahead: int = 0, states: Sequence[bool] = ()):
        """One namespace (or its 16-byte root key, then give chunk_size) per TP
        rank; `windows`: per KV-cache group, its sliding window in tokens (0:
        full attention); `lossy_form`: plan with that lossy form of the chunks;
        `lookahead`: the drafter's prefill lookahead (chunking.py); `states`:
        per KV-cache group, whether it holds linear-attention state (default none)."""
        if not namespaces:
            raise ValueError("need one namespace per TP rank")
        exact_roots = tuple(ns if isinstance(ns, bytes) else ns.root_key() for ns in namespaces)
        first = namespaces[0]
        self.chunk_size = chunk_size or (first.chunk_size if isinstance(first, Namespace) else 0)
        if self.chunk_size <= 0:
            raise ValueError("chunk_size is needed when namespaces are given as root keys")
        self.block_size = block_size
        self.store_tail = store_tail
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"windows must be one size >= 0 per KV-cache group, got {tuple(windows)}")
        self.windows = tuple(int(w) for w in windows)
        self.states = tuple(bool(x) for x in states) or (False,) * len(self.windows)
        if len(self.states) != len(self.windows):
            raise ValueError(f"states must be one flag per KV-cache group ({len(self.windows)}), got {tuple(states)}")
        if self.chunk_size % block_size:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of block_size {block_size}")
        self.chunker = Chunker(exact_roots, self.chunk_size, block_size if store_tail else None, lossy_form,
                               lookahead)
        self.roots = self.chunker.roots  # the tags of its chunks (lossy roots with a lossy form)

    # ------------------------------------------------------------- units --
    def units(self, tokens: Sequence[int] | np.ndarray, extras: ExtraInputs | None = None) -> list[Unit]:
        """Full chunks, then the tail piece (if any full block remains)."""
        return self.chunker.units(tokens, extras)

    def max_loadable(self, prompt_len: int) -> int:
        """vLLM must compute at least one prompt token: whole blocks below len-1."""
        return max(0, (prompt_len - 1) // self.block_size * self.block_size)

    # ------------------------------------------------------------ lookup --
    def lookup(self, chain: TierChain, tokens: Sequence[int] | np.ndarray, units: list[Unit], count: bool = True,
               lower: bool = True, extras: ExtraInputs | None = None, tiers: dict[int, str] | None = None
               ) -> tuple[int, list[Unit], list[Unit]]:
        """(tokens shmkv can supply, the units that hold them, those of them
        below the shared tier, to promote first). The cached prefix is the
        chain's walk (shared tier, then disk and remote with `lower`); the
        count leaves at least one token to compute (vLLM's rule) and is cut
        back to a unit start where a sliding window would not cover it.
        `tiers`, if given, gets each returned unit's tier by its start (a
        unit seen before keeps the tier it was first found in)."""
        found = self.chunker.cached_prefix(chain, tokens, units, count=count, lower=lower, extras=extras)
        hit = min(found[-1][0].end if found else 0, self.max_loadable(len(tokens)))
        if found and found[-1][0].start < hit < found[-1][0].end and not self._windows_cover(found[-1][0], hit):
            hit = found[-1][0].start
        state = None
        if any(self.states) and hit:
            # the hit ends where a recurrent state is held: the last such unit end within it
            cands = [u.state_unit() for u, _ in reversed(found) if u.end <= hit]
            state = chain.first_held(cands, self.roots, lower) if cands else None
            hit = state[0].end if state is not None else 0
        keep = [(u, tier) for u, tier in found if u.start < hit] + ([state] if state is not None else [])
        if tiers is not None:
            for u, tier in keep:
                tiers.setdefault(u.start, tier)
        return hit, [u for u, _ in keep], [u for u, tier in keep if tier != SHM]

    # ----------------------------------------------------- group windows --
    def stored_blocks(self, u: Unit, group: int) -> tuple[int, int]:
        """(first block of the unit, number of blocks) that `group` stores of unit `u`."""
        bs, w = self.block_size, self.windows[group]
        if self.states[group]:
            return 0, 0  # a recurrent state is its own entry (state_unit), not part of a unit's payload
        n = u.tokens // bs
        if not w:
            return 0, n
        first = max(u.start, u.end - w + 1) // bs - u.start // bs
        return first, n - first

    def _window_start(self, group: int, hit_end: int) -> int:
        """First token position `group` needs for a hit of `hit_end` tokens
        (vLLM's sliding-window skip rule: the next token sees the last W-1)."""
        w = self.windows[group]
        return max(0, hit_end - w + 1) if w else 0

    def _windows_cover(self, u: Unit, hit_end: int) -> bool:
        """Whether every group's stored part of `u` holds what a hit ending at hit_end needs of it."""
        bs = self.block_size
        for g in range(len(self.windows)):
            need = max(u.start, self._window_start(g, hit_end)) // bs - u.start // bs
            if need < self.stored_blocks(u, g)[0]:
                return False
        return True

    # ---------------------------------------------------------- loading --
    def load_items(self, plan: RequestPlan) -> list[LoadItem]:
        """Items that fill tokens [local, local + hit) into the request's
        blocks, each a window of one found unit's payload (per group: only
        the blocks the group needs, none of vLLM's null blocks)."""
        lo, hi = plan.local_tokens, plan.local_tokens + plan.hit_tokens
        bs = self.block_size
        items = []
        for u in plan.hit_units:
            if u.state:
                items.extend(self._state_load(plan, u))
                continue
            a, b = max(u.start, lo), min(u.end, hi)
            if a >= b:
                continue
            groups = []
            for g, ids in enumerate(plan.block_ids):
                if self.states[g]:
                    groups.append(GroupWindow(0, 0, ()))
                    continue
                first, n = self.stored_blocks(u, g)
                p0 = max(a, self._window_start(g, hi)) // bs  # first request position this group needs
                p0 = min(p0, b // bs)
                blocks = tuple(ids[p0:b // bs])
                if p0 - u.start // bs < first or NULL_BLOCK in blocks:
                    raise ValueError(f"request {plan.req_id}: group {g} needs blocks the unit at {u.start} "
                                     "did not store (a planning bug)")
                groups.append(GroupWindow(p0 - u.start // bs - first, n, blocks))
            items.append(LoadItem(plan.req_id, u.keys, tuple(groups)))
        return items

    def _state_load(self, plan: RequestPlan, u: Unit) -> list[LoadItem]:
        """The state entry `u` into the blocks of each linear-attention group
        that hold it in the load step. vLLM's align mode keeps in block p the
        state after (p + 1) * block_size tokens: the hit's end h is block
        h / block_size - 1 (vLLM caches it as that prefix's state), and the
        step's running state, which the forward reads, is block
        cdiv(h + scheduled, block_size) - 1. vLLM copies the first into the
        second before the forward (preprocess_mamba), which may run before
        the connector's load: both are filled."""
        h, bs = plan.local_tokens + plan.hit_tokens, self.block_size
        if u.end != h:
            raise ValueError(f"request {plan.req_id}: the state after token {u.end} does not end the hit of "
                             f"{h} tokens (a planning bug)")
        targets = []
        for idx in dict.fromkeys((h // bs - 1, -(-(h + plan.scheduled_tokens) // bs) - 1)):
            blocks = {}
            for g in (g for g, st in enumerate(self.states) if st):
                table = plan.block_ids[g] if g < len(plan.block_ids) else []
                if not 0 <= idx < len(table) or table[idx] == NULL_BLOCK:
                    raise ValueError(f"request {plan.req_id}: vLLM allocated no block {idx} for group {g}'s "
                                     f"state after token {h}")
                blocks[g] = table[idx]
            targets.append(LoadItem(plan.req_id, u.keys, self._state_windows(blocks)))
        return targets

    def _state_windows(self, blocks: dict[int, int]) -> tuple[GroupWindow, ...]:
        """A state entry's windows: one block per linear-attention group, nothing of the others."""
        return tuple(GroupWindow(0, 1, (blocks[g],)) if st else GroupWindow(0, 0, ())
                     for g, st in enumerate(self.states))

    def group_blocks(self, u: Unit) -> list[tuple[int, int, int]]:
        """(group, first block of the prompt, blocks) that each group holds of
        unit `u` (a state entry: the block of the state after its end)."""
        bs = self.block_size
        if u.state:
            return [(g, u.end // bs - 1, 1) for g, st in enumerate(self.states) if st]
        return [(g, u.start // bs + first, n) for g in range(len(self.windows)) if not self.states[g]
                for first, n in [self.stored_blocks(u, g)]]

    def store_state_items(self, plan: RequestPlan, offers: Sequence[tuple[int, int, int]]) -> list[StoreItem]:
        """The recurrent states vLLM hands over this step ((group, block id,
        boundary tokens), kv_connector_block_state.boundary_state_offloads),
        one entry per unit end whose state every linear-attention group offers
        (other boundaries, and those shmkv supplied, are not stored)."""
        by_end: dict[int, dict[int, int]] = {}
        for g, block, end in offers:
            if 0 <= g < len(self.states) and self.states[g] and block != NULL_BLOCK:
                by_end.setdefault(int(end), {})[g] = int(block)
        hit_end = plan.local_tokens + plan.hit_tokens if plan.hit_tokens else 0
        need = {g for g, st in enumerate(self.states) if st}
        items = []
        for u in plan.units:
            blocks = by_end.get(u.end)
            if blocks is None or set(blocks) != need or u.end <= hit_end or u.end > plan.prompt_len:
                continue
            items.append(StoreItem(plan.req_id, u.state_unit().keys, 0, self._state_windows(blocks), plan.roots))
        return items

    # ---------------------------------------------------------- storing --
    def store_items(self, plan: RequestPlan, computed_after: int) -> list[StoreItem]:
        """Units fully computed once this step ends, not supplied by shmkv."""
        items = []
        bs = self.block_size
        hit_end = plan.local_tokens + plan.hit_tokens if plan.hit_tokens else 0
        while plan.next_store < len(plan.units):
            u = plan.units[plan.next_store]
            if u.end > min(computed_after, plan.prompt_len) or any(
                    u.end > len(ids) * bs for g, ids in enumerate(plan.block_ids) if not self.states[g]):
                break
            plan.next_store += 1
            if u.end <= hit_end:
                continue  # it came from shmkv: cached already
            groups = []
            for g, ids in enumerate(plan.block_ids):
                first, n = self.stored_blocks(u, g)
                p0 = u.start // bs + first
                groups.append(GroupWindow(0, n, tuple(ids[p0:p0 + n]) if n else ()))
            if any(NULL_BLOCK in w.block_ids or len(w.block_ids) < w.payload_blocks for w in groups):
                plan.window_skipped += 1  # vLLM's own prefix hit padded the window with null blocks
                continue
            items.append(StoreItem(plan.req_id, u.keys, u.tokens, tuple(groups), plan.roots))
        return items
