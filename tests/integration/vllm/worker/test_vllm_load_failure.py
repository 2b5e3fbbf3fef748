"""A chunk evicted between the scheduler's lookup and the worker's load (what
another engine's eviction does under memory pressure), on both of vLLM's
model runners: the output equals vLLM alone and the engine serves on.

Model Runner V2 (what vLLM 0.32 runs on a GPU) cannot take a failed
synchronous load back: given the blocks in invalid_block_ids it still
sampled from them (a run of one repeated token, reproduced here), so every
load on V2 is asynchronous (WAITING_FOR_REMOTE_KVS) and a failure recomputes
the request. V1 takes the blocks back in the step that read them."""

from __future__ import annotations

import pytest
from helpers import E2E_TOKENS, random_prompt

from shmkv.testing import EVICT_BEFORE_LOAD

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=5)


@pytest.mark.v1  # both runners (conftest: V2 runs every case, V1 the marked ones)
def test_a_chunk_evicted_before_its_load_is_recomputed_right(cache_name, start_engine, reference, vllm_runner):
    want = reference.output(P, 0)
    cfg = {"cache_name": cache_name, "capacity": "64MiB"}
    first = start_engine("stores", shmkv=cfg)
    assert first.generate([P], max_tokens=E2E_TOKENS)["outputs"] == [want]
    first.close()
    evicting = start_engine("evicted-before-load", shmkv=cfg, env={EVICT_BEFORE_LOAD: "1"},
                            llm_kwargs={"disable_log_stats": False})
    r = evicting.generate([P], max_tokens=E2E_TOKENS)
    assert r["outputs"] == [want]
    assert evicting.metrics().get("vllm:shmkv_load_failed_blocks", 0) > 0, "the load did fail"
    log = open(evicting.log_path).read()
    if vllm_runner == "v2":
        assert r["num_cached_tokens"] == [0], "V2: the request was recomputed whole (an asynchronous load)"
    assert f"TEST SWITCH {EVICT_BEFORE_LOAD}='1' is on" in log
    assert evicting.generate([P], max_tokens=E2E_TOKENS)["outputs"] == [want], "the engine serves on"
