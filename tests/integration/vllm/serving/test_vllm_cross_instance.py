"""(a) A second, separate vLLM engine process loads the prompt's KV from the
shared tier, both while the first runs and after it has exited; the KV bytes
it loads equal those the first computed, and its greedy output equals a run
without the connector (at the same split). (b) A prompt sharing a 2,000-token
prefix loads exactly the shared full chunks."""

from __future__ import annotations

import pytest
from helpers import E2E_TOKENS, check_loaded_bytes_equal_stored, random_prompt

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=1)
Q = P[:2000] + random_prompt(1000, seed=2)


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
def test_second_engine_loads_while_first_runs_and_after_it_exits(cache_name, start_engine, reference, tmp_path):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}

    # every engine is a process of its own; b keeps vLLM's own process split (EngineCore and worker
    # processes), so its loads reach the worker as pickled metadata, as deployed (its processes forked on
    # either runner: the split is what this checks; test_vllm_async_stores keeps V1's spawn)
    a = start_engine("a", shmkv=cfg)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0]
    assert first["outputs"][0] == reference.output(P, 0)

    b = start_engine("b-while-a-runs", shmkv=cfg, in_process=False, fork_children=True)
    r = b.generate([P])
    hit = r["num_cached_tokens"][0]
    assert hit >= 0.9 * len(P)
    assert hit == 2944, "11 chunks and the 128-token tail piece"
    assert len(r["outputs"][0]) == E2E_TOKENS
    assert r["outputs"][0] == reference.output(P, hit)
    assert check_loaded_bytes_equal_stored(digests) == 12

    a.close()
    b.close()  # every process has left the segment now

    c = start_engine("c-after-exit", shmkv=cfg)
    r = c.generate([P])
    assert r["num_cached_tokens"][0] == 2944
    assert r["outputs"][0] == reference.output(P, 2944)
    assert check_loaded_bytes_equal_stored(digests) == 24

    # (b) a prompt sharing only its first 2,000 tokens
    rq = c.generate([Q])
    assert rq["num_cached_tokens"][0] == 2000 // 256 * 256 == 1792
    assert rq["outputs"][0] == reference.output(Q, 1792)
