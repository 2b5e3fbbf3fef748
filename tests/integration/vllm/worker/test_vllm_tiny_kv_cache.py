"""An engine whose KV cache holds only a few prompts keeps serving, with the
connector on and with it off. Every stored request's blocks are freed
late (vLLM's delayed frees, until the workers report the stores done), so a
connector whose halves disagree stalls such an engine as soon as its cache
has filled once.

Regression (shmkv cdea691): a draft model of another head size than its
target shares one KV-cache group with it (vLLM's UniformTypeKVCacheSpecs);
the workers turned the connector off for that group while the scheduler
half kept it on and delayed every stored request's free, and the engine
hung after 4 requests. Now such a group is copied per shape; and where a
worker alone refuses (the test switch SHMKV_TEST_WORKER_OFF), its start report
turns the whole engine off and vLLM serves on."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv.engines.models import TinyLlama, write_llama
from shmkv.testing import WORKER_OFF

pytestmark = pytest.mark.slow

PROMPTS = [random_prompt(1000, seed=100 + i) for i in range(8)]  # each over a fifth of the KV cache
TINY = {"num_gpu_blocks_override": 40, "disable_log_stats": False}  # 40 blocks of 128 tokens


@pytest.fixture(scope="module")
def small_head_drafter(tmp_path_factory) -> str:
    """A drafter of head size 32 for the head-size-64 test model."""
    return write_llama(str(tmp_path_factory.mktemp("drafter-head32")),
                       TinyLlama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256))


def serve_all(engine) -> None:
    for i, p in enumerate(PROMPTS):
        # NOTE: a stalled engine never answers: the timeout turns the hang into a failure
        r = engine.call(cmd="generate", prompts=[p], max_tokens=16, salts=None, timeout=180)
        assert len(r["outputs"][0]) == 16, f"request {i}"


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
def test_a_drafter_of_another_head_size_with_a_tiny_kv_cache_keeps_serving(cache_name, start_engine, model_dir,
                                                                            small_head_drafter):
    spec = {"speculative_config": {"method": "draft_model", "model": small_head_drafter, "num_speculative_tokens": 3},
            **TINY}
    engine = start_engine("tiny-drafter", shmkv={"cache_name": cache_name}, llm_kwargs=spec)
    serve_all(engine)
    m = engine.metrics()
    assert m["vllm:shmkv_connector_on"] == 1
    # 3 chunks and a 128-token piece per prompt; the last one's may reach the metrics with a later step
    assert m["vllm:shmkv_stored_tokens"] >= 7 * 896, "the stores went on as the cache filled"
    assert "connector off" not in open(engine.log_path).read()


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
def test_workers_off_with_the_scheduler_on_keeps_serving(cache_name, start_engine):
    # vLLM's own process split: the worker's report reaches EngineCore pickled, as deployed; its processes
    # forked on either runner (the split is what this checks; test_vllm_async_stores keeps V1's spawn)
    engine = start_engine("tiny-split", shmkv={"cache_name": cache_name}, env={WORKER_OFF: "the split"},
                          llm_kwargs=TINY, in_process=False, fork_children=True)
    serve_all(engine)
    assert engine.metrics()["vllm:shmkv_connector_on"] == 0
    log = open(engine.log_path).read()
    off = [line for line in log.splitlines() if "connector off for this engine" in line]
    assert len(off) == 1 and off[0].startswith("WARNING"), off
    assert f"TP rank 0's worker cannot serve it: {WORKER_OFF}: the split" in off[0]
