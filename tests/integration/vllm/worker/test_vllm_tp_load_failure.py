"""No rank stores over another rank's failed load (#63 item 4): at tensor
parallel 2, an engine's rank 1 finds its chunks gone between the
scheduler's lookup and its own load (a test switch deletes them, as another
engine's eviction would) while rank 0 loads its own; the same engine stored
them first (a miss: the switch acts on loads only). The step computes the
new tokens over rank 1's unfilled blocks, and the all-reduce spreads that to
rank 0. vLLM recomputes, and no rank stores anything of that request: on
b7fe4e6 rank 0 stored its shards of the step's new chunk (a poisoned shard
that a later engine's full hit would load).

Model Runner V1 only: V2 loads asynchronously (test_vllm_load_failure.py),
so a failed load there recomputes the whole request on every rank and
nothing is ever computed over an unfilled block."""

from __future__ import annotations

import pytest
from helpers import random_prompt, read_digests, wait_until

from shmkv.engines.engine import TP2_ON_TWO_CORES
from shmkv.testing import EVICT_BEFORE_LOAD

pytestmark = pytest.mark.slow

CHUNK = 256


def stores(digests: str) -> list[tuple[str, ...]]:
    return [r for r in read_digests(digests) if r[0] == "store"]


@pytest.mark.v1  # conftest: V2 runs every case, V1 the marked ones
def test_no_rank_stores_over_another_ranks_failed_load(cache_name, start_engine, tmp_path, vllm_runner):
    if vllm_runner == "v2":
        pytest.skip("Model Runner V2 loads asynchronously: a failed load recomputes the request on every rank")
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    tp2 = {"llm_kwargs": {"tensor_parallel_size": 2}}
    first = random_prompt(2 * CHUNK + 8, seed=53)
    # one engine stores, then loads (vLLM's own prefix cache off: the second prompt's hit is shmkv's); the
    # switch acts on loads only, so the first prompt (a miss) stores its chunks untouched
    b = start_engine("tp-rank1-evicts", shmkv=cfg, env={**TP2_ON_TWO_CORES, EVICT_BEFORE_LOAD: "rank:1"}, **tp2)
    assert b.generate([first])["num_cached_tokens"] == [0]
    wait_until(lambda: len(stores(digests)) == 4, "2 chunks stored, one shard per rank")
    before = stores(digests)
    assert len({r[1] for r in before}) == 4, "2 chunks, one shard per rank"

    longer = first[:2 * CHUNK] + random_prompt(CHUNK + 8, seed=54)  # a third chunk computed over the hit
    got = b.generate([longer])
    assert len(got["outputs"][0]) > 0, "vLLM recomputed and answered"
    b.close()  # every store it began has ended
    log = open(b.log_path).read()
    assert f"TEST SWITCH {EVICT_BEFORE_LOAD}='rank:1' is on" in log
    assert stores(digests) == before, "no rank stored any chunk of the request rank 1's load failed for"
    assert "computed over a load that failed (this rank's or another TP rank's)" in log
