"""The native tier across hosts: an engine whose shmkv tier writes through to
Redis (remote_write_through) and an engine on another host (another
segment, the same remote_url) that finds the chunks there, promotes them
into its own segment while its lookups answer RETRY, and loads them
byte-equal; without write-through nothing reaches Redis before a spill."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import numpy as np
from helpers import NativeEngine, wait_until
from vllm.v1.kv_offload.base import LookupResult

pytestmark = pytest.mark.slow


def test_an_engine_on_another_host_loads_what_was_written_through(cache_name, second_cache, redis_server):
    a = NativeEngine(cache_name, "A", tier={"remote_url": redis_server.url, "remote_write_through": True})
    try:
        ks = a.keys(8)
        a.store(ks)
        assert a.tier.chain.flush(timeout_s=30)["remote_flushed"]
    finally:
        a.close()
    b = NativeEngine(second_cache, "B", tier={"remote_url": redis_server.url})  # another host's segment
    try:
        first = [b.manager.lookup(k, b.ctx) for k in ks]
        assert LookupResult.HIT not in first, "nothing in B's own segment yet"
        wait_until(lambda: b.step() or all(b.manager.lookup(k, b.ctx) is LookupResult.HIT for k in ks),
                   "B promotes the chunks from Redis")
        spec = b.manager.prepare_load(ks, b.ctx)
        n = b.chunk_bytes
        for k, cid in zip(ks, np.asarray(spec.chunk_ids)):
            assert b.view[int(cid) * n:(int(cid) + 1) * n].tobytes() == (bytes(k) * n)[:n]
        b.manager.complete_load(ks, b.ctx)
        assert b.tier.store.stats()["remote_hits"] == 8
    finally:
        b.close()


def test_without_write_through_nothing_is_written_at_store_time(cache_name, redis_server):
    a = NativeEngine(cache_name, "A", tier={"remote_url": redis_server.url})
    try:
        a.store(a.keys(4))
        assert a.tier.chain.flush(timeout_s=30)["remote_flushed"]
        assert redis_server.client().dbsize() == 0
    finally:
        a.close()
