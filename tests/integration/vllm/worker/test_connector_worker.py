"""The connector's worker half without vLLM: loads report the blocks they
could not fill (evicted, or the store broke) instead of raising; stores that
find the store full or the key present are skipped and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.integration.vllm.planner import GroupWindow, LoadItem, StoreItem
from shmkv.transfer import TransferEngine as KVWorker
from shmkv.transfer.layout import KVLayout

BS = 16


def stored(key: bytes, *block_ids: int) -> StoreItem:
    """A one-group unit of whole blocks, as the planner makes them."""
    return StoreItem("r", (key,), len(block_ids) * BS, (GroupWindow(0, len(block_ids), block_ids),))


def loaded(key: bytes, *block_ids: int) -> LoadItem:
    return LoadItem("q", (key,), (GroupWindow(0, len(block_ids), block_ids),))


@pytest.fixture
def setup(cache_name):
    store = Store.create(cache_name, 8 << 20, alignment=256)
    src = make_cache("cpu", 2, 8, BS, 2, 8, torch.bfloat16, seed=1)
    dst = make_cache("cpu", 2, 8, BS, 2, 8, torch.bfloat16, seed=2)
    yield store, KVWorker(store, KVLayout("cpu", src), 0), KVWorker(store, KVLayout("cpu", dst), 0), src, dst
    store.close()


def test_store_then_load_into_another_cache(setup):
    store, a, b, src, dst = setup
    a.store([stored(b"k1" * 8, 3, 5), stored(b"k2" * 8, 6)])
    assert a.counters["stored_units"] == 2
    failed, done = b.load([loaded(b"k1" * 8, 0, 1), loaded(b"k2" * 8, 2)])
    assert failed == set() and done["q"][0] == 3 * BS
    for s, d in zip(src, dst):
        for a_blk, b_blk in ((3, 0), (5, 1), (6, 2)):
            assert torch.equal(s[a_blk].view(torch.uint8), d[b_blk].view(torch.uint8))
    assert store.stats()["leases_held"] == 0


def test_missing_units_are_reported_not_raised(setup):
    store, a, b, _, _ = setup
    a.store([stored(b"k1" * 8, 3)])
    failed, done = b.load([loaded(b"k1" * 8, 0),
                           loaded(b"gone" * 4, 1, 2),
                           loaded(b"after" * 3 + b"!", 4)])
    assert failed == {1, 2, 4}, "the first miss ends the prefix: later units are not loaded either"
    assert done["q"][0] == BS
    assert b.counters["load_missing_units"] == 2


def test_a_broken_scatter_is_reported_and_the_lease_returned(setup):
    store, a, b, _, _ = setup
    a.store([stored(b"k1" * 8, 3)])
    failed, _ = b.load([loaded(b"k1" * 8, 99)])  # block id out of range
    assert failed == {99} and b.counters["load_errors"] == 1
    assert store.stats()["leases_held"] == 0


def test_full_and_existing_stores_are_skipped(cache_name):
    store = Store.create(cache_name, 1 << 20, alignment=256, max_entries=64)
    src = make_cache("cpu", 2, 64, BS, 2, 8, torch.bfloat16)
    w = KVWorker(store, KVLayout("cpu", src), 0)
    unit = w.layout.payload_bytes(BS)
    n = store.arena_bytes // unit
    for i in range(n):
        store.put(i.to_bytes(16, "little"), np.zeros(unit, np.uint8))
        store.pin(i.to_bytes(16, "little"))
    w.store([stored(b"new" * 5 + b"!", 1), stored((0).to_bytes(16, "little"), 2)])
    assert w.counters["store_full"] == 1 and w.counters["store_exists"] == 1
    t = w.finish("r")
    assert t.not_stored == 1 and t.already_cached == 1 and t.stored_units == 0
    store.close()


def test_pipelined_load_signals_each_layer_then_releases(setup):
    store, a, b, src, dst = setup
    a.store([stored(b"k1" * 8, 3, 5)])
    job = b.submit_load([loaded(b"k1" * 8, 0, 1)])
    for name in b.layout.names:  # as vLLM's attention layers would, in order
        job.wait_layer(name)
        i = b.layout.layer_index(name)
        assert torch.equal(src[i][3].view(torch.uint8), dst[i][0].view(torch.uint8))
    [(done_job, failed)] = b.poll_loads()
    assert done_job is job and failed == set() and job.loaded["q"] == 2 * BS
    assert store.stats()["leases_held"] == 0


def test_a_kv_cache_shmkv_cannot_copy_turns_the_worker_half_off(cache_name):
    """vLLM keeps serving: registration logs why, every promised load is
    reported for recompute, stores are skipped, nothing raises."""
    from types import SimpleNamespace

    from shmkv.config import load_config
    from shmkv.integration.vllm.engine_inputs import KVGroup
    from shmkv.integration.vllm.worker import WorkerSide

    store = Store.create(cache_name, 8 << 20, alignment=256)
    side = WorkerSide(load_config({"cache_name": cache_name}), store, [KVGroup(())], 0, BS)
    bad = torch.zeros(2, 4, BS, 2, 8, dtype=torch.bfloat16)  # 5-D: not a vLLM 0.32 view
    side.register_kv_caches({"layer.0": bad})
    assert side.worker is None and "5-D KV cache tensor" in side.off_reason
    meta = SimpleNamespace(loads=[loaded(b"k1" * 8, 3, 4)], stores=[stored(b"k2" * 8, 5)], summaries={},
                           failed_blocks=set())
    side.bind(meta)
    side.start_load(meta)
    side.wait_layer("layer.0")
    side.wait_for_save(meta)
    assert side.load_errors() == {3, 4}
    assert store.stats()["puts"] == 0
    assert side.get_finished({"q"}) == (None, None), "q stored nothing: vLLM did not delay its free"
    assert side.get_finished({"r"}) == ({"r"}, None), "r had store items: vLLM delayed it, so it is reported"
    store.close()
