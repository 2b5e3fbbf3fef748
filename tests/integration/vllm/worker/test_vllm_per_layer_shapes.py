"""A target whose layers differ in KV shape (vLLM's DeciLM / Nemotron-NAS:
each layer its own number of KV heads, here 2 and 1) is one KV-cache group
of two shapes (UniformTypeKVCacheSpecs), copied per shape: a second engine
hits what the first stored, the KV it loads is byte-equal to what was
stored, and its greedy output equals an engine without shmkv that
recomputed from the same split."""

from __future__ import annotations

import pytest
from helpers import E2E_TOKENS, check_loaded_bytes_equal_stored, random_prompt

from shmkv.engines.models import write_decilm

pytestmark = pytest.mark.slow

P = random_prompt(1500, seed=47)
HIT = 1408  # 5 chunks and a 128-token piece


@pytest.fixture(scope="module")
def decilm_dir(tmp_path_factory) -> str:
    return write_decilm(str(tmp_path_factory.mktemp("decilm")), kv_heads=(2, 1))


def test_layers_of_other_kv_head_counts_hit_byte_exact(cache_name, start_engine, decilm_dir, tmp_path):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    engine = {"model_dir": decilm_dir, "llm_kwargs": {"trust_remote_code": True}}
    a = start_engine("decilm-a", shmkv=cfg, **engine)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0]
    assert "copied per shape (sections 0:2x128x128/bfloat16/1;1x128x128/bfloat16/1)" in open(a.log_path).read()

    b = start_engine("decilm-b", shmkv=cfg, **engine)
    r = b.generate([P])
    assert r["num_cached_tokens"] == [HIT]
    assert check_loaded_bytes_equal_stored(digests) == 2 * 6, "both shapes' sections of all 6 units"

    ref = start_engine("decilm-ref", shmkv=None, prefix_caching=True, **engine)
    ref.generate([P[:HIT + 1]], max_tokens=1)  # vLLM's own prefix cache holds the same split
    r_ref = ref.generate([P], max_tokens=E2E_TOKENS)
    assert r_ref["num_cached_tokens"] == [HIT]
    assert r["outputs"] == r_ref["outputs"]
