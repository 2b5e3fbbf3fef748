"""kv_role is honoured: a producer only stores and a consumer only loads, so a
prefill engine and a decode engine on one host form a disaggregated pair. The
producer runs chunked prefill (512-token steps), storing chunk by chunk."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=41)


def test_producer_stores_consumer_loads(cache_name, start_engine, reference):
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    prod = start_engine("producer", shmkv=cfg, kv_role="kv_producer", max_num_batched_tokens=512)
    cons = start_engine("consumer", shmkv=cfg, kv_role="kv_consumer")
    store = Store.attach(cache_name)

    assert prod.generate([P])["num_cached_tokens"] == [0]
    puts = store.stats()["puts"]
    assert puts == 12, "11 chunks + the tail piece, stored across chunked-prefill steps"
    assert prod.generate([P])["num_cached_tokens"] == [0], "a producer never loads"

    r = cons.generate([P])
    assert r["num_cached_tokens"] == [2944]
    assert r["outputs"][0] == reference.output(P, 2944)

    other = random_prompt(1500, seed=42)
    cons.generate([other])
    assert store.stats()["puts"] == puts, "a consumer never stores"
    assert cons.generate([other])["num_cached_tokens"] == [0]
    store.close()
