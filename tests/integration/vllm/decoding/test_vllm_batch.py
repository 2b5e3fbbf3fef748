"""(d) One batch mixing hits, partial hits and misses: every output equals
its no-connector output at its own split."""

from __future__ import annotations

import pytest
from helpers import random_prompt

pytestmark = pytest.mark.slow


def test_batch_of_hits_and_misses(cache_name, start_engine, reference):
    p1, p2 = random_prompt(1500, seed=21), random_prompt(1200, seed=22)
    e = start_engine("batch", shmkv={"cache_name": cache_name, "capacity": "256MiB"})
    warm = e.generate([p1, p2])  # two requests stored in one batch
    assert warm["num_cached_tokens"] == [0, 0]

    miss = random_prompt(1000, seed=23)
    partial = p1[:900] + random_prompt(400, seed=24)
    batch = [p1, miss, partial, p2]
    r = e.generate(batch)
    # p1: 5 chunks + 1-block piece; partial: 3 chunks; p2: 4 chunks + 1-block piece
    assert r["num_cached_tokens"] == [1408, 0, 768, 1152]
    for prompt, out, hit in zip(batch, r["outputs"], r["num_cached_tokens"]):
        assert out == reference.output(prompt, hit)
