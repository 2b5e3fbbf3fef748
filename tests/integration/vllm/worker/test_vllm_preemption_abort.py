"""Preemption and resumption, and a request aborted mid-prefill, with chunked
prefill (512-token steps) and a KV cache of only 40 blocks."""

from __future__ import annotations

import pytest
from helpers import check_loaded_bytes_equal_stored, cuda_vllm_missing, random_prompt, wait_until

from shmkv import Store

pytestmark = pytest.mark.slow

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    cuda_vllm_missing() is not None, reason=cuda_vllm_missing() or "")])]


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
@pytest.mark.parametrize("device", DEVICES)
def test_resumed_request_reloads_its_own_chunks_and_abort_leaves_only_good_chunks(
        cache_name, start_engine, reference, tmp_path, device):
    """Stores are in flight when vLLM preempts (handle_preemptions orders them
    before the blocks are reused) and when the request is aborted (its free is
    delayed until they are reported). On "cuda": CUDA graphs on, outputs
    checked through the loaded bytes only."""
    digests = str(tmp_path / "digests.txt")
    extra = {"enforce_eager": False} if device == "cuda" else {}
    e = start_engine("preempt", shmkv={"cache_name": cache_name, "capacity": "256MiB",
                                       "debug_digest_file": digests},
                     max_num_batched_tokens=512,
                     llm_kwargs={"num_gpu_blocks_override": 40, "disable_log_stats": False, **extra})
    store = Store.attach(cache_name)

    # 4 x 10 blocks of prompt fill the cache; decoding past 1,280 tokens needs
    # more blocks, so vLLM preempts a request and later resumes it. 500 tokens:
    # even three requests running together outgrow the cache (3 x 14 blocks > 40;
    # at 200 tokens, 3 x 11 fit and nothing was preempted).
    prompts = [random_prompt(1200, seed=s) for s in range(51, 55)]
    r = e.generate(prompts, max_tokens=500)
    assert all(len(o) == 500 for o in r["outputs"])
    assert e.metrics().get("vllm:num_preemptions", 0) >= 1
    assert store.stats()["hits"] > 0, "the resumed request loaded its prefix from shmkv"
    assert check_loaded_bytes_equal_stored(digests), "the resumed request's units were loaded whole"

    # abort a request once its prefill reached token 1,536 (its 512-token hit, then two 512-token
    # steps; on V2 the hit loads asynchronously, in a step of its own)
    prompt = prompts[0][:700] + random_prompt(1000, seed=56)
    puts = store.stats()["puts"]
    assert e.abort_after_tokens(prompt, tokens=1536)["aborted"]
    # its stores complete after the abort (vLLM keeps its blocks until they are reported)
    wait_until(lambda: store.stats()["puts"] >= puts + 4, "the aborted request's 4 chunks (512..1536) committed")
    # what it stored before the abort (chunks up to token 1,536) is correct
    r = e.generate([prompt])
    assert r["num_cached_tokens"] == [1536]
    assert device == "cuda" or r["outputs"][0] == reference.output(prompt, 1536)
    assert check_loaded_bytes_equal_stored(digests)
    store.close()
