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
from worker_steps import NAMES, loaded, run_vllm_step, step, stored, worker_side

from shmkv import Store


@pytest.fixture
def store(cache_name):
    s = Store.create(cache_name, 16 << 20, alignment=256)
    yield s
    s.close()


def test_a_store_pending_at_sleep_commits_the_bytes_the_cache_held_before_it(store):
    """The store's copy has not run when vLLM sleeps; sleep then frees the KV
    cache (here: overwritten). The chunk holds the bytes from before, and
    the request is reported finished once."""
    side, caches = worker_side(store, 1)
    before = [caches[n][3].clone() for n in NAMES]
    assert run_vllm_step(side, step(stores=[stored("r", b"k1" * 8, 3)]), finished={"r"}) == (None, set())
    assert side.worker.pending_requests() == {"r"}, "the copy is still pending (deferred)"
    side.suspend()  # the connector's unregister_kv_caches
    assert side.worker.pending_stores() == []
    for n in NAMES:  # what sleep mode does to the KV cache's memory
        caches[n].view(torch.uint8).fill_(0xEE)
    assert side.get_finished(set())[0] == {"r"}
    other, other_caches = worker_side(store, 2)
    assert run_vllm_step(other, step(loads=[loaded("q", b"k1" * 8, 5)]))[1] == set()
    for n, b in zip(NAMES, before):
        assert torch.equal(other_caches[n][5].view(torch.uint8), b.view(torch.uint8)), n
    side.suspend()  # idempotent
    side.shutdown()
    other.shutdown()


def test_no_copy_runs_between_unregister_and_restore(store, caplog):
    """A step asked for before restore_kv_caches (vLLM never does) runs no
    copy: its loads are recomputed, its stores dropped, both counted."""
    writer, _ = worker_side(store, 3)
    run_vllm_step(writer, step(stores=[stored("w", b"k2" * 8, 2)]), finished={"w"})
    writer.shutdown()
    side, caches = worker_side(store, 4)
    side.suspend()
    untouched = caches[NAMES[0]][6].clone()
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        sending, errors = run_vllm_step(side, step(loads=[loaded("q", b"k2" * 8, 6)],
                                           stores=[stored("s", b"k3" * 8, 1)]), finished={"s"})
    assert errors == {6}, "vLLM recomputes the block the load would have filled"
    assert torch.equal(caches[NAMES[0]][6], untouched)
    assert sending == {"s"} and store.get(b"k3" * 8) is None
    assert side.worker.counters["copies_refused_asleep"] == 2
    assert sum("sleep mode" in r.getMessage() for r in caplog.records) == 2
    side.resume()  # restore_kv_caches
    assert run_vllm_step(side, step(loads=[loaded("q2", b"k2" * 8, 6)]))[1] == set()
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
