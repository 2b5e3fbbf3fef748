"""(e) A shared tier far smaller than the working set: chunks are evicted,
nothing fails, every output equals its no-connector output."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow


def test_store_too_small_for_the_working_set(cache_name, start_engine, reference):
    e = start_engine("small", shmkv={"cache_name": cache_name, "capacity": "4MiB"})
    prompts = [random_prompt(2600, seed=s) for s in (31, 32, 33)]  # ~2.6 MB of KV each
    seen_hits = []
    for _ in range(2):
        for p in prompts:
            r = e.generate([p])
            hit = r["num_cached_tokens"][0]
            seen_hits.append(hit)
            assert r["outputs"][0] == reference.output(p, hit)
    st = Store.attach(cache_name).stats()
    assert st["evictions"] > 0 or st["put_full"] > 0, st
    assert st["bytes_used"] <= st["arena_bytes"]
