"""What the native tier tells vLLM: KV events (each chunk this engine stored,
medium CPU, and each of those once it has left the shared segment: evicted
to make room for another engine's chunks, or cleared) and metrics (every
name get_stats emits is declared by build_metric_definitions, as vLLM's
Prometheus logger requires, with counts that match what happened)."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

from helpers import NativeEngine, wait_until
from vllm.v1.kv_offload.base import Medium
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from shmkv import Store
from shmkv.integration.vllm.native_tier import METRIC_PREFIX

pytestmark = pytest.mark.slow

CHUNK = 256 << 10  # the chunks NativeEngine makes: 16 blocks of 16 KiB


def events_of(engine: NativeEngine) -> list:
    return [e for e in engine.manager.take_events() if e.ownership == "shmkv"]


def keys_in(events: list, removed: bool) -> set:
    return {k for e in events if e.removed is removed for k in e.keys}


def test_stored_chunks_are_reported_then_reported_removed_when_evicted(cache_name):
    # room for about 16 chunks: B's 32 push out all of A's 16 (the least recently used)
    a = NativeEngine(cache_name, "A", events=True, tier={"capacity": 16 * CHUNK + (1 << 20)})
    b = NativeEngine(cache_name, "B", events=True)
    try:
        first = a.keys(16, seed=1)
        a.store(first)
        stored = events_of(a)
        assert keys_in(stored, False) == set(first)
        assert all(e.medium is Medium.CPU for e in stored)
        b.store(b.keys(32, seed=2))
        assert b.tier.store.stats()["evictions"] >= 16
        seen: list = []
        wait_until(lambda: seen.extend(events_of(a)) or keys_in(seen, True) == set(first),
                   "engine A reports its evicted chunks removed")
        assert not keys_in(seen, False)
        assert a.tier.counters["removed"] == 16
        assert keys_in(events_of(b), True) < set(b.keys(32, seed=2)), "B's own evicted chunks, not all"
    finally:
        a.close()
        b.close()


def test_a_cleared_segment_is_reported_removed(cache_name):
    a = NativeEngine(cache_name, "A", events=True)
    try:
        ks = a.keys(20)
        a.store(ks)
        assert keys_in(events_of(a), False) == set(ks)
        with Store.attach(cache_name) as other:
            assert other.clear() == 20
        seen: list = []
        wait_until(lambda: seen.extend(events_of(a)) or keys_in(seen, True) == set(ks), "removals after a clear")
    finally:
        a.close()


def test_no_events_without_kv_events(cache_name):
    a = NativeEngine(cache_name, "A")
    try:
        a.store(a.keys(4))
        assert events_of(a) == [] and a.tier._announced == {}
    finally:
        a.close()


def test_every_metric_is_declared_and_counts_what_happened(cache_name):
    a = NativeEngine(cache_name, "A")
    b = NativeEngine(cache_name, "B")
    try:
        ks = a.keys(8)
        a.store(ks)
        wait_until(lambda: b.step() or all(b.manager.lookup(k, b.ctx).name == "HIT" for k in ks),
                   "B promotes A's chunks")
        stats = b.manager.get_stats()
        declared = TieringOffloadingSpec.build_metric_definitions(b.spec.config.extra_config)
        emitted = set(stats.data["data"])
        assert emitted <= set(declared), emitted - set(declared)
        flat = stats.reduce()
        assert flat[METRIC_PREFIX + "loaded"] == 8
        assert flat[METRIC_PREFIX + "hits"] == 8
        assert flat[METRIC_PREFIX + "segment_used_bytes"] >= 8 * CHUNK
        again = b.tier.get_stats().reduce()
        assert METRIC_PREFIX + "loaded" not in again, "counters are reported as increments, once"
        assert a.tier.get_stats().reduce()[METRIC_PREFIX + "stored"] == 8
    finally:
        a.close()
        b.close()
