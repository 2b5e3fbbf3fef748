"""vLLM 0.33's sleep mode: unregister_kv_caches comes before vLLM frees or
remaps the KV cache, and vLLM assumes no transfer touches it afterwards
(vllm/v1/worker/gpu_worker.py sleep/discard). shmkv's stores are
asynchronous: the worker half drains them there, and runs no copy until
restore_kv_caches. Driven without vLLM (0.32, installed here, never calls
these hooks); the hooks' names and signatures are checked against 0.33's
sources by test_vllm_interface."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.config import load_config
from shmkv.integration.vllm.engine_inputs import KVGroup
from shmkv.integration.vllm.planner import GroupWindow, LoadItem, StoreItem
from shmkv.integration.vllm.worker import WorkerSide

BS, LAYERS, BLOCKS = 16, 2, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def step(stores=(), loads=()) -> SimpleNamespace:
    return SimpleNamespace(stores=list(stores), loads=list(loads), preempted=set(), summaries={},
                           failed_blocks=set())


def stored(req: str, key: bytes, *blocks: int) -> StoreItem:
    return StoreItem(req, (key,), len(blocks) * BS, (GroupWindow(0, len(blocks), blocks),))


def loaded(req: str, key: bytes, *blocks: int) -> LoadItem:
    return LoadItem(req, (key,), (GroupWindow(0, len(blocks), blocks),))


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 16 << 20, alignment=256)
    yield s
    s.close()


def worker_side(store: Store, seed: int) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A registered worker half whose CPU copies run only when waited for
    (as a GPU's stream would, later than the step that issued them)."""
    caches = dict(zip(NAMES, make_cache("cpu", LAYERS, BLOCKS, BS, 2, 8, torch.bfloat16, seed=seed)))
    side = WorkerSide(load_config({"cache_name": store.name}, env={}), store, [KVGroup(tuple(NAMES))], 0, BS,
                      deferred=True)
    side.register_kv_caches(caches)
    assert side.worker is not None, side.off_reason
    return side, caches


def issue(side: WorkerSide, meta, finished=()) -> tuple[set[str] | None, set[int]]:
    side.bind(meta)
    side.handle_preemptions(meta)
    side.start_load(meta)
    for name in NAMES:
        side.wait_layer(name)
    side.wait_for_save(meta)
    sending, _ = side.get_finished(set(finished))
    return sending, side.load_errors()


def test_a_store_pending_at_sleep_commits_the_bytes_the_cache_held_before_it(store):
    """The store's copy has not run when vLLM sleeps; sleep then frees the KV
    cache (here: overwritten). The chunk holds the bytes from before, and
    the request is reported finished once."""
    side, caches = worker_side(store, 1)
    before = [caches[n][3].clone() for n in NAMES]
    assert issue(side, step(stores=[stored("r", b"k1" * 8, 3)]), finished={"r"}) == (None, set())
    assert side.worker.pending_requests() == {"r"}, "the copy is still pending (deferred)"
    side.suspend()  # the connector's unregister_kv_caches
    assert side.worker.pending_stores() == []
    for n in NAMES:  # what sleep mode does to the KV cache's memory
        caches[n].view(torch.uint8).fill_(0xEE)
    assert side.get_finished(set())[0] == {"r"}
    other, other_caches = worker_side(store, 2)
    assert issue(other, step(loads=[loaded("q", b"k1" * 8, 5)]))[1] == set()
    for n, b in zip(NAMES, before):
        assert torch.equal(other_caches[n][5].view(torch.uint8), b.view(torch.uint8)), n
    side.suspend()  # idempotent
    side.shutdown()
    other.shutdown()


def test_no_copy_runs_between_unregister_and_restore(store, caplog):
    """A step asked for before restore_kv_caches (vLLM never does) runs no
    copy: its loads are recomputed, its stores dropped, both counted."""
    writer, _ = worker_side(store, 3)
    issue(writer, step(stores=[stored("w", b"k2" * 8, 2)]), finished={"w"})
    writer.shutdown()
    side, caches = worker_side(store, 4)
    side.suspend()
    untouched = caches[NAMES[0]][6].clone()
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        sending, errors = issue(side, step(loads=[loaded("q", b"k2" * 8, 6)],
                                           stores=[stored("s", b"k3" * 8, 1)]), finished={"s"})
    assert errors == {6}, "vLLM recomputes the block the load would have filled"
    assert torch.equal(caches[NAMES[0]][6], untouched)
    assert sending == {"s"} and store.get(b"k3" * 8) is None
    assert side.worker.counters["copies_refused_asleep"] == 2
    assert sum("sleep mode" in r.getMessage() for r in caplog.records) == 2
    side.resume()  # restore_kv_caches
    assert issue(side, step(loads=[loaded("q2", b"k2" * 8, 6)]))[1] == set()
    assert not torch.equal(caches[NAMES[0]][6], untouched), "awake again: the load ran"
    side.shutdown()


def test_the_connector_says_it_supports_sleep_mode_and_forwards_the_hooks():
    from shmkv.integration.vllm.connector import ShmKVConnector

    calls = []
    conn = ShmKVConnector.__new__(ShmKVConnector)
    conn._work = SimpleNamespace(suspend=lambda: calls.append("suspend"), resume=lambda: calls.append("resume"))
    assert ShmKVConnector.supports_sleep_mode(None) is True
    conn.unregister_kv_caches()
    conn.restore_kv_caches()
    assert calls == ["suspend", "resume"]
    conn._work = None  # the scheduler's instance: nothing to do
    conn.unregister_kv_caches()
