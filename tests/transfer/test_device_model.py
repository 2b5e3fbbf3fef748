"""The device-like stream model (tests/support/device_model.py) and its order
checker, under the transfer engine:

  * nothing runs when issued or waited on: copies run only when the host
    synchronizes on something that depends on them, in a seeded order;
  * the checker names the block, both operations and their steps when an
    access is not ordered after a conflicting earlier one, and stays silent
    when the engine's fences are in place;
  * removing one fence of the engine (the store stream's wait for the
    compute, a layer's wait for its load, the preemption wait) produces a
    violation, and some seeded orders then also produce wrong bytes.
"""

from __future__ import annotations

import pytest
import torch
from device_model import DeviceModel
from kv_reference import make_cache

from shmkv import Store
from shmkv.transfer import GroupWindow, LoadItem, StoreItem, TransferEngine
from shmkv.transfer.layout import KVLayout

BS, LAYERS, BLOCKS = 16, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


_ENGINES: list[TransferEngine] = []


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 16 << 20, alignment=256)
    yield s
    while _ENGINES:  # their copies finish (commit, release) before the store closes
        _ENGINES.pop().shutdown()
    s.close()


def engine(store: Store, dev: DeviceModel, seed: int = 1) -> tuple[TransferEngine, list[torch.Tensor]]:
    caches = make_cache("cpu", LAYERS, BLOCKS, BS, 2, 8, torch.bfloat16, seed=seed)
    for n, t in zip(NAMES, caches):
        dev.name_tensor(t, n)
    eng = TransferEngine(store, KVLayout("cpu", caches, NAMES), 0, backend=dev)
    _ENGINES.append(eng)
    return eng, caches


def item(req: str, key: bytes, *blocks: int) -> StoreItem:
    return StoreItem(req, (key,), len(blocks) * BS, (GroupWindow(0, len(blocks), blocks),))


def load_item(req: str, key: bytes, *blocks: int) -> LoadItem:
    return LoadItem(req, (key,), (GroupWindow(0, len(blocks), blocks),))


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def forward(dev: DeviceModel, caches, blocks, *, value: float | None = None, waits=None) -> None:
    """A forward over `blocks`: each layer reads them (and writes `value` into them, if given)."""
    for n, t in zip(NAMES, caches):
        if waits is not None:
            waits(n)

        def fn(t=t) -> None:
            if value is not None:
                t[list(blocks)] = value
        dev.compute(f"forward {n}", fn, [(t, blocks, "rw" if value is not None else "r")])


def test_nothing_runs_until_something_depends_on_it(store):
    dev = DeviceModel(seed=0, query_progress=0.0)
    eng, caches = engine(store, dev)
    before = [t.clone() for t in caches]
    eng.submit_store([item("a", b"k" * 16, 1, 2)])
    job = eng._stores[0]
    assert not job.event.query() and eng.poll_stores() == [], "a store's gather has not run by itself"
    assert store.stats()["ready_entries"] == 0
    eng.order_compute_after_stores()  # records a dependency; runs nothing
    assert not job.event.op.done
    dev.compute("zero block 1", lambda: caches[0][1].zero_(), [(caches[0], [1], "w")])
    assert not job.event.op.done, "compute is a stream too: issuing it runs nothing"
    dev.sync_compute()  # the host waits for the compute, which waits for the store
    assert job.event.op.done and eng.poll_stores() == [job]
    assert not dev.violations
    want = raw(before[0][1])
    assert store.get(b"k" * 16)[:len(want)] == want, "the gather ran before the zeroing that waited for it"
    assert not caches[0][1].view(torch.uint8).any()
    assert store.stats()["ready_entries"] == 1


def test_a_write_not_ordered_after_a_pending_gather_is_named(store):
    dev = DeviceModel(seed=0)
    eng, caches = engine(store, dev)
    dev.step = 7
    eng.submit_store([item("a", b"k" * 16, 3, 4)])
    dev.step = 8
    dev.compute("zero new blocks", lambda: caches[1][4].zero_(), [(caches[1], [4], "w")])
    assert len(dev.violations) == 1
    v = str(dev.violations[0])
    assert "model.layers.1.self_attn.attn[4]" in v and "store gather of a" in v and "(step 7)" in v
    assert "zero new blocks" in v and "(step 8)" in v


def test_the_preemption_fence_orders_the_write(store):
    dev = DeviceModel(seed=0)
    eng, caches = engine(store, dev)
    eng.submit_store([item("a", b"k" * 16, 3, 4)])
    assert eng.order_compute_after_stores({"a"}) == 1
    dev.compute("zero new blocks", lambda: caches[1][4].zero_(), [(caches[1], [4], "w")])
    assert dev.violations == []


def test_a_host_observation_orders_what_is_issued_after_it(store):
    dev = DeviceModel(seed=0, query_progress=1.0)
    eng, caches = engine(store, dev)
    eng.submit_store([item("a", b"k" * 16, 3, 4)])
    assert [j.item.req_id for j in eng.poll_stores()] == ["a"], "the polled event ran (query_progress 1)"
    dev.compute("zero new blocks", lambda: caches[1][4].zero_(), [(caches[1], [4], "w")])
    assert dev.violations == [], "the host saw the gather complete before it issued the write"


def test_a_load_is_read_only_after_the_layer_waits_for_it(store):
    src = DeviceModel(seed=0)
    a, a_caches = engine(store, src, seed=1)
    a.submit_store([item("a", b"k" * 16, 1, 2)])
    a.wait_stores()
    for seed in range(4):
        dev = DeviceModel(seed=seed)
        b, b_caches = engine(store, dev, seed=2)
        job = b.submit_load([load_item("b", b"k" * 16, 5, 6)])
        forward(dev, b_caches, [5, 6], waits=job.wait_layer)
        dev.sync_compute()
        assert dev.violations == []
        b.poll_loads()
        assert job.failed == set()
        for x, y in zip(a_caches, b_caches):
            assert raw(x[[1, 2]]) == raw(y[[5, 6]])


def test_a_layer_that_does_not_wait_reads_before_its_load(store):
    a, _ = engine(store, DeviceModel(seed=0))
    a.submit_store([item("a", b"k" * 16, 1, 2)])
    a.wait_stores()
    dev = DeviceModel(seed=0)
    b, b_caches = engine(store, dev, seed=2)
    job = b.submit_load([load_item("b", b"k" * 16, 5, 6)])
    forward(dev, b_caches, [5, 6], waits=lambda n: n != NAMES[1] and job.wait_layer(n))
    assert {v.later for v in dev.violations} == {f"{dev.compute_stream.last!r}"}
    assert {v.block for v in dev.violations} == {f"{NAMES[1]}[5]", f"{NAMES[1]}[6]"}
    assert f"load {NAMES[1]}" in dev.violations[0].earlier


def test_removing_the_store_streams_wait_for_the_compute_is_caught(store, monkeypatch):
    """The forward writes a block's KV; the store of that block must gather after it."""
    wrong = 0
    for seed in range(12):
        dev = DeviceModel(seed=seed)
        eng, caches = engine(store, dev)
        key = bytes([seed]) * 16
        forward(dev, caches, [2], value=float(seed + 1))
        monkeypatch.setattr(eng._store_stream, "after_compute", lambda: None)  # the fence removed
        eng.submit_store([item(f"r{seed}", key, 2)])
        assert dev.violations and "store gather of r" in dev.violations[0].later
        assert f"forward {NAMES[0]}" in dev.violations[0].earlier
        dev.synchronize()
        eng.poll_stores()
        got = store.get(key)[:16]
        wrong += got != raw(caches[0][2])[:16]
    assert wrong, "in some seeded order the gather ran before the forward's write"


def test_with_every_fence_no_order_is_wrong(store):
    for seed in range(12):
        dev = DeviceModel(seed=seed)
        eng, caches = engine(store, dev)
        key = bytes([seed]) * 16
        forward(dev, caches, [2], value=float(seed + 1))
        eng.submit_store([item(f"r{seed}", key, 2)])
        forward(dev, caches, [6], value=-1.0)  # later compute on other blocks may overlap the gather
        dev.synchronize()
        eng.poll_stores()
        assert dev.violations == []
        got = store.get(key)[:16]
        assert got == raw(caches[0][2])[:16]


@pytest.mark.parametrize("seed", range(6))
def test_a_load_into_blocks_a_pending_store_reads_runs_after_the_gather(store, seed):
    """Finding A: vLLM freed a request's blocks while their store was still
    copying and gave them to a load, possibly in no list the scheduler half
    sees (a request parked for an asynchronous load). The transfer engine
    orders the load after the gathers reading its blocks, whatever it was
    told: a store into {3, 4}, then a load of another key into {4, 5}."""
    dev = DeviceModel(seed=seed, query_progress=0.0)
    eng, caches = engine(store, dev)
    other = bytes([seed + 100]) * 16
    store.put(other, b"\x07" * (2 * 2 * BS * 2 * 8 * 2 * LAYERS), tokens=2 * BS)  # what the load brings
    forward(dev, caches, [3, 4], value=float(seed + 1))
    block = raw(torch.full_like(caches[0][3], float(seed + 1)))  # what the forward writes, once it runs
    key = bytes([seed]) * 16
    eng.submit_store([item("r", key, 3, 4)])
    eng.submit_load([load_item("h", other, 4, 5)])
    dev.synchronize()
    eng.poll_stores()
    eng.poll_loads()
    assert dev.violations == [], dev.violations[:2]
    got = store.get(key)
    assert got is not None and got[:2 * len(block)] == 2 * block, "the store holds the forward's KV"
    assert eng.counters["loads_after_stores"] == 1
