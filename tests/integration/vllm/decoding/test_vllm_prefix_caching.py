"""(c) The connector with vLLM's own prefix cache on: shmkv supplies what the
local cache lacks, also when the local hit ends in the middle of a chunk."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=1)
Q = P[:2000] + random_prompt(1000, seed=2)


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
def test_shmkv_and_vllm_prefix_cache_together(cache_name, start_engine, reference):
    e = start_engine("apc", shmkv={"cache_name": cache_name, "capacity": "256MiB"}, prefix_caching=True)
    e.generate([P])  # computed, stored in shmkv, and cached locally by vLLM
    e.reset_prefix_cache()  # now only shmkv has it

    r = e.generate([Q])
    assert r["num_cached_tokens"][0] == 1792
    assert r["outputs"][0] == reference.output(Q, 1792)

    e.reset_prefix_cache()
    e.generate([P[:700]], max_tokens=1)  # vLLM's own cache now holds 5 blocks (640 tokens)
    store = Store.attach(cache_name)
    hits_before = store.stats()["hits"]
    r = e.generate([P])
    assert r["num_cached_tokens"][0] == 2944, "640 local + 2304 from shmkv, starting mid-chunk"
    assert r["outputs"][0] == reference.output(P, 2944)
    assert store.stats()["hits"] > hits_before
    store.close()
