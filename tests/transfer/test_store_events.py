"""A step's stores record one event per request, not one per unit (#50 E-G:
on a GPU each is a CUDA event recorded and later queried): a request's
units of the step share it and commit together; the waits that order
compute or loads after pending stores wait once per event. Driven through
deferred CPU streams (a copy runs only when something waits for it)."""

from __future__ import annotations

import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.transfer import GroupWindow, StoreItem, TransferEngine
from shmkv.transfer.layout import KVLayout

BS, LAYERS, BLOCKS = 16, 2, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def item(req: str, key: bytes, *blocks: int) -> StoreItem:
    return StoreItem(req, (key,), len(blocks) * BS, (GroupWindow(0, len(blocks), blocks),))


def engine(store: Store) -> TransferEngine:
    caches = make_cache("cpu", LAYERS, BLOCKS, BS, 2, 8, torch.bfloat16, seed=1)
    return TransferEngine(store, KVLayout("cpu", caches, NAMES), 0, deferred=True)


def test_a_requests_units_of_a_step_share_one_event_and_commit_together(store):
    eng = engine(store)
    eng.submit_store([item("a", b"a1" * 8, 1), item("a", b"a2" * 8, 2), item("a", b"a3" * 8, 3),
                      item("b", b"b1" * 8, 4), item("b", b"b2" * 8, 5)])
    jobs = eng.pending_stores()
    events = {r: {id(j.event) for j in jobs if j.item.req_id == r} for r in "ab"}
    assert [len(events["a"]), len(events["b"])] == [1, 1] and events["a"] != events["b"]
    a_event = next(j.event for j in jobs if j.item.req_id == "a")
    a_event.synchronize()  # a's copies ran, b's (after them on the stream) not yet
    assert sorted(j.item.keys[0] for j in eng.poll_stores()) == \
        [b"a1" * 8, b"a2" * 8, b"a3" * 8]
    assert eng.pending_requests() == {"b"}
    eng.wait_stores()
    assert eng.tallies["a"].stored_units == 3 and eng.tallies["b"].stored_units == 2
    assert all(store.get(k * 8) is not None for k in (b"a1", b"a2", b"a3", b"b1", b"b2"))
    eng.shutdown()


def test_ordering_after_a_requests_stores_waits_once_per_event(store):
    eng = engine(store)
    eng.submit_store([item("a", b"a1" * 8, 1), item("a", b"a2" * 8, 2), item("b", b"b1" * 8, 4)])
    assert eng.order_compute_after_stores({"a"}) == 1, "a's two units: one event"
    assert eng.poll_stores() and eng.pending_requests() == {"b"}
    assert eng.order_compute_after_stores() == 1
    eng.shutdown()


def test_a_unit_that_fails_to_issue_is_given_back_only_after_its_requests_event(store):
    """A block id outside the cache: that unit's copy cannot be issued, its
    neighbour's is queued before it; the room goes back once the shared event
    (after both) completed, the good unit is committed."""
    eng = engine(store)
    eng.submit_store([item("a", b"a1" * 8, 1), item("a", b"a2" * 8, BLOCKS + 3)])
    good, bad = eng.pending_stores()
    assert bad.failed and bad.reservation.is_open and good.event is bad.event
    eng.wait_stores()
    assert not bad.reservation.is_open and eng.counters["store_errors"] == 1
    assert store.get(b"a1" * 8) is not None and store.get(b"a2" * 8) is None
    eng.shutdown()
