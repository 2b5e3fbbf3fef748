"""shmkv in vLLM's own metrics: a second engine's hit shows in
vllm:prompt_tokens_cached_by_source{source="host"} (the shared tier), and
the connector's transfer stats reach vllm:shmkv_loaded_tokens_total,
vllm:shmkv_stored_tokens_total and the load/store latency histograms
(vLLM's metrics reader names counters without their _total)."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=41)
STATS = {"disable_log_stats": False}


def test_hits_by_tier_and_transfer_stats_in_vllm_metrics(cache_name, start_engine):
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    a = start_engine("metrics-a", shmkv=cfg, llm_kwargs=STATS)
    assert a.generate([P])["num_cached_tokens"] == [0]
    ma = a.metrics()
    assert ma.get("vllm:shmkv_stored_tokens") == 896, "3 chunks and the 128-token piece"
    assert ma.get("vllm:shmkv_store_seconds_count", 0) >= 1
    assert ma.get("vllm:shmkv_loaded_tokens", 0) == 0

    b = start_engine("metrics-b", shmkv=cfg, llm_kwargs=STATS)
    assert b.generate([P])["num_cached_tokens"] == [896]
    mb = b.metrics()
    assert mb.get("vllm:prompt_tokens_cached_by_source{source=host}") == 896
    assert mb.get("vllm:shmkv_loaded_tokens") == 896
    assert mb.get("vllm:shmkv_load_seconds_count", 0) >= 1
    assert mb.get("vllm:shmkv_load_failed_blocks", 0) == 0
    with Store.attach(cache_name) as s:  # the same count in shmkv's own statistics (shmkv_hit_tokens_total)
        st = s.stats()
    assert (st["hit_tokens"], st["disk_hit_tokens"], st["remote_hit_tokens"]) == (896, 0, 0)
    assert st["put_tokens"] == 896, "stored once by A (shmkv_put_tokens_total{tier=\"shm\"}); B found them cached"
