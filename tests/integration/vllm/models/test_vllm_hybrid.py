"""A hybrid sliding-window model (Llama with `layer_types` alternating
sliding and full attention) with vLLM's hybrid KV-cache manager on: engine A
stores with chunked prefill (so vLLM frees sliding-window blocks between its
steps), engine B hits across engines with the output of a run without shmkv
at the same split, and the KV bytes it loads equal, group by group, those A
stored."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import E2E_TOKENS, Reference, check_loaded_bytes_equal_stored, random_prompt, read_digests

from shmkv.engines.models import TinyLlama, write_llama

pytestmark = pytest.mark.slow

WINDOW = 160  # under one chunk: a sliding layer stores only the last 2 blocks of each
MODEL = TinyLlama(num_hidden_layers=4, sliding_window=WINDOW,
                  layer_types=("sliding_attention", "full_attention") * 2)
P = random_prompt(1000, seed=31)
Q = P[:700] + random_prompt(400, seed=32)


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory) -> str:
    return write_llama(str(tmp_path_factory.mktemp("hybrid-llama")), MODEL)


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
def test_sliding_window_model_hits_across_engines(cache_name, start_engine, hybrid_dir, tmp_path):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    reference = Reference(start_engine("hybrid-ref", model_dir=hybrid_dir, shmkv=None, prefix_caching=True))

    a = start_engine("hybrid-a", model_dir=hybrid_dir, shmkv=cfg, max_num_batched_tokens=384)
    r = a.generate([P])
    assert r["num_cached_tokens"] == [0]
    assert r["outputs"][0] == reference.output(P, 0)
    log_a = open(a.log_path).read()
    assert "Turning off hybrid kv cache manager" not in log_a
    assert "hybrid KV cache, 2 groups: 2 layers with a 160-token sliding window; 2 layers with full attention" in log_a

    b = start_engine("hybrid-b", model_dir=hybrid_dir, shmkv=cfg)
    r = b.generate([P])
    assert r["num_cached_tokens"] == [896], "3 chunks and the 128-token piece"
    assert len(r["outputs"][0]) == E2E_TOKENS
    assert r["outputs"][0] == reference.output(P, 896)
    assert check_loaded_bytes_equal_stored(digests) >= 4
    whole = Counter(row[2] for row in read_digests(digests) if row[0] == "load" and row[3] == "0" and row[4] == row[5])
    assert whole["0"] >= 1 and whole["1"] >= 4, f"both groups compared: {whole}"

    r = b.generate([Q])
    assert r["num_cached_tokens"] == [512]
    assert r["outputs"][0] == reference.output(Q, 512)
