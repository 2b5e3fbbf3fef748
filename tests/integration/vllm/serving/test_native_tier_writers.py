"""A chunk another process is writing into the shared segment right now:
the native tier's lookup answers RETRY (vLLM asks again next step) instead
of MISS, HIT once the writer commits, and MISS once a writer has held it
past WRITING_RETRY_S (a frozen or killed writer never stalls a request); a
writer that aborted leaves the next writer of the chunk a window of its own;
a store of a chunk another engine is writing is not reported stored."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import time
import types

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

from helpers import NativeEngine
from vllm.v1.kv_offload.base import LookupResult

from shmkv import PutResult, Store
from shmkv.integration.vllm import native_tier

pytestmark = pytest.mark.slow


@pytest.fixture
def engine(cache_name):
    e = NativeEngine(cache_name, "B")
    yield e
    e.close()


def test_a_chunk_being_written_is_retried_then_hit(engine, cache_name):
    (k,) = engine.keys(1)
    shm_key = engine.tier.key_of(k)
    writer = Store.attach(cache_name)  # another engine's handle on the segment
    try:
        r = writer.reserve(shm_key, engine.tier.chunk_bytes, namespace=engine.tier.root)
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.RETRY
        assert engine.manager.lookup(k, engine.ctx) is LookupResult.RETRY, "vLLM's manager passes it on"
        r.view()[:] = b"\x01" * engine.tier.chunk_bytes
        assert r.commit() is PutResult.OK
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.HIT
        assert engine.tier.counters["retries_writing"] == 2
    finally:
        writer.close()


def test_a_writer_that_never_commits_turns_into_a_miss(engine, cache_name, monkeypatch):
    (k,) = engine.keys(1, seed=2)
    writer = Store.attach(cache_name)
    try:
        r = writer.reserve(engine.tier.key_of(k), engine.tier.chunk_bytes)
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.RETRY
        monkeypatch.setattr(native_tier, "WRITING_RETRY_S", 0.0)  # as if WRITING_RETRY_S had passed
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.MISS
        r.abort()
    finally:
        writer.close()


def test_an_aborted_writer_leaves_the_next_writer_its_own_window(engine, cache_name, monkeypatch):
    """A writer that holds the chunk and aborts (a hostile neighbour, or a
    store that failed) must not spend the window of the honest writer after it."""
    (k,) = engine.keys(1, seed=4)
    shm_key = engine.tier.key_of(k)
    clock = [1000.0]  # the tier's monotonic clock, moved by hand
    monkeypatch.setattr(native_tier, "time", types.SimpleNamespace(
        **{**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")}, "monotonic": lambda: clock[0]}))
    writer = Store.attach(cache_name)
    try:
        r = writer.reserve(shm_key, engine.tier.chunk_bytes, namespace=engine.tier.root)
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.RETRY
        r.abort()
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.MISS  # nobody writes it now
        clock[0] += 10 * native_tier.WRITING_RETRY_S  # long after the first writer's window would have closed
        r = writer.reserve(shm_key, engine.tier.chunk_bytes, namespace=engine.tier.root)
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.RETRY, "the honest writer's own window"
        r.view()[:] = b"\x02" * engine.tier.chunk_bytes
        assert r.commit() is PutResult.OK
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.HIT
    finally:
        writer.close()


def test_a_store_of_a_chunk_another_engine_is_writing_is_not_reported_stored(engine, cache_name):
    """BUSY is not stored: the other engine's write may still be aborted,
    and vLLM must not count on a chunk the segment does not hold."""
    (k,) = engine.keys(1, seed=3)
    writer = Store.attach(cache_name)
    try:
        r = writer.reserve(engine.tier.key_of(k), engine.tier.chunk_bytes, namespace=engine.tier.root)
        engine.store([k])
        assert (engine.tier.counters["not_stored"], engine.tier.counters["already_held"]) == (1, 0)
        r.abort()  # the other engine's write never lands
        assert engine.tier.lookup(k, engine.ctx) is LookupResult.MISS
    finally:
        writer.close()
