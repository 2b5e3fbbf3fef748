"""What waits to be announced is bounded and blocks nothing: chunks whose
store never lands (an engine that died, a store that failed) neither delay
the announcement of a chunk that did land by more than a step or two, nor
grow without bound; older waiting chunks are still checked, a window a step."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from shmkv import Store
from shmkv.integration.vllm import kv_events
from shmkv.integration.vllm.kv_events import EventGroup, SharedTierEvents
from shmkv.integration.vllm.planner import Planner, RequestPlan
from shmkv.keys import Namespace

BS = 128
NS = Namespace(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=64, chunk_size=256,
               block_size=BS, attention_layout="cpu:LBHNC")


def planned(events: SharedTierEvents, chunks: int, seed: int) -> list:
    """`chunks` chunks of one request planned for storing; their units."""
    p = Planner([NS], BS)
    tokens = np.arange(chunks * 256) + seed * 10_000_000
    units = RequestPlan(f"r{seed}", len(tokens), p.units(tokens)).units
    req = SimpleNamespace(block_hashes=[bytes([seed % 256, i % 256, i // 256 % 256]) * 11 for i in range(2 * chunks)],
                          all_token_ids=list(tokens), lora_request=None, cache_salt=None, mm_features=[],
                          prompt_embeds=None, session_id=None)
    events.stores_planned(req, [(u, p.group_blocks(u)) for u in units])
    return units


def test_a_stored_chunk_is_announced_at_once_behind_many_that_never_land(cache_name):
    with Store.create(cache_name, 16 << 20, alignment=64, populate=False) as store:
        events = SharedTierEvents(store, BS, [EventGroup()])
        planned(events, 1100, seed=1)  # stores that never land
        for _ in range(3):
            assert events.take_events() == []
        (unit,) = planned(events, 1, seed=2)
        store.put(unit.keys[0], b"x" * 64)
        got = events.take_events() or events.take_events()
        assert len(got) == 1 and got[0].token_ids == list(range(20_000_000, 20_000_256))


def test_an_older_waiting_chunk_is_still_announced_when_it_lands(cache_name):
    with Store.create(cache_name, 16 << 20, alignment=64, populate=False) as store:
        events = SharedTierEvents(store, BS, [EventGroup()])
        units = planned(events, 3000, seed=3)
        for _ in range(5):
            events.take_events()
        store.put(units[10].keys[0], b"x" * 64)  # one of the oldest, landing late
        steps = 0
        while not (got := events.take_events()):
            steps += 1
            assert steps <= 3000 // kv_events.CHECK_KEYS_PER_STEP + 1, "the window reached it within one round"
        assert len(got) == 1


def test_what_waits_is_bounded(cache_name):
    with Store.create(cache_name, 16 << 20, alignment=64, populate=False) as store:
        events = SharedTierEvents(store, BS, [EventGroup()])
        planned(events, kv_events.MAX_PENDING + 500, seed=4)
        assert len(events._pending) == kv_events.MAX_PENDING
        assert events.counters["pending_dropped"] == 500
