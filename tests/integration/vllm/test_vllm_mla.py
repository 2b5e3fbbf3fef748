"""MLA once per host: a DeepSeek-V2-shaped model (one latent KV that every
TP rank holds whole) at tensor parallel 2 stores one chunk set, not one per
rank; every rank of a second TP=2 engine loads it byte for byte, with the output of the
first engine. (Another TP size is another namespace: its all-reduces sum in
another order, so its latent KV differs in the last bits.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from helpers import random_prompt, read_digests

pytestmark = pytest.mark.slow

P = random_prompt(600, seed=47)
HIT = 592  # 2 chunks and a 5-block piece (vLLM-CPU forces 16-token blocks for MLA)
TP2 = {"env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
       "llm_kwargs": {"block_size": 16, "tensor_parallel_size": 2}}


def shm_entries(cache: str) -> int:
    out = subprocess.run([sys.executable, "-m", "shmkv.stats", "--cache", cache, "--json"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return json.loads(out)["shm"]["entries"]


def test_one_chunk_set_per_host_loaded_by_every_rank(cache_name, start_engine, mla_dir, tmp_path):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}

    a = start_engine("mla-a", model_dir=mla_dir, shmkv=cfg, **TP2)
    r_a = a.generate([P])
    assert r_a["num_cached_tokens"] == [0]
    a.close()
    log_a = open(a.log_path).read()
    assert "TP rank 1 only loads" in log_a
    assert shm_entries(cache_name) == 3, "2 chunks and the piece, once (not once per rank)"

    b = start_engine("mla-b", model_dir=mla_dir, shmkv=cfg, **TP2)
    r_b = b.generate([P])
    assert r_b["num_cached_tokens"] == [HIT]
    assert r_b["outputs"] == r_a["outputs"]
    rows = read_digests(digests)
    stored = {r[1]: r[3] for r in rows if r[0] == "store"}
    loads = [r for r in rows if r[0] == "load"]
    assert len(stored) == 3
    assert Counter(r[1] for r in loads) == Counter({k: 2 for k in stored}), "each chunk loaded by both ranks"
    assert all(r[3] == "0" and r[4] == r[5] and r[6] == stored[r[1]] for r in loads), "byte-equal on every rank"
    assert shm_entries(cache_name) == 3
