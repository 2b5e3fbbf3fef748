"""Linear-attention state end to end: a Qwen3-Next-shaped hybrid (gated
delta net + full attention, vLLM's align mode with prefix caching on). A
second engine hits the prefix a first one stored, loading the recurrent
state with the attention KV, and its greedy output equals an engine without
shmkv; so does a repeat of the prompt served from vLLM's own prefix cache
(the block vLLM cached as the prefix's state was filled too); with the state
load skipped (the test-only fault switch) the output differs, so this test
would catch a hybrid loading KV without state; after every engine and the
segment are gone, the disk tier serves the same hit; and a load that fails
(its chunks deleted between lookup and load) is recomputed by vLLM with the
same output, the engine serving on."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv import Store
from shmkv.config import load_config
from shmkv.engines.models import write_hybrid
from shmkv.services.maintainer import Maintainer
from shmkv.testing import EVICT_BEFORE_LOAD, SKIP_LOAD_LAYERS
from shmkv.tiers import open_tiers

pytestmark = pytest.mark.slow

P = random_prompt(1500, seed=53)
HIT = 1408  # the last whole 128-token block below the prompt's end: where vLLM keeps the state


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
def test_the_state_is_restored_with_the_attention_kv(cache_name, start_engine, tmp_path_factory, tmp_path):
    model = write_hybrid(str(tmp_path_factory.mktemp("qwen3_next")), "qwen3_next")
    cfg = {"cache_name": cache_name, "capacity": "64MiB", "disk_dir": str(tmp_path / "disk")}

    def engine(label, shmkv, **kw):  # kw: EngineSpec's fields (env: a test switch)
        return start_engine(label, model_dir=model, shmkv=shmkv, prefix_caching=True, max_model_len=2048, **kw)

    plain = engine("plain", None)
    want = plain.generate([P])["outputs"]
    plain.close()

    first = engine("first", cfg)
    r = first.generate([P])
    assert r["num_cached_tokens"] == [0] and r["outputs"] == want
    log = open(first.log_path).read()
    assert "linear-attention state is restored with the attention KV" in log
    assert "connector off" not in log
    first.close()
    with Store.attach(cache_name) as s:
        # 5 chunks + the 128-token piece of attention KV, and the state after the piece
        assert s.stats()["entries"] == 7, s.stats()

    second = engine("second", cfg)
    r = second.generate([P])
    assert r["num_cached_tokens"] == [HIT] and HIT >= 0.8 * len(P)
    assert r["outputs"] == want
    # vLLM cached the block of the prefix's state when it admitted the hit: served from
    # vLLM's own prefix cache now, the output is the same
    again = second.generate([P])
    assert again["num_cached_tokens"] == [HIT] and again["outputs"] == want
    second.close()

    blind = engine("state-skipped", cfg, env={SKIP_LOAD_LAYERS: "linear_attn"})
    r = blind.generate([P])
    assert r["num_cached_tokens"] == [HIT]
    assert r["outputs"] != want, "attention KV loaded without its state must change the output"
    blind.close()

    # every chunk written to disk (POST /flush's work), then every engine gone and the
    # segment too: the disk tier keeps the chunks and the state
    with Store.attach(cache_name) as store:
        chain = open_tiers(load_config(cfg, env={}), store)
        try:
            assert Maintainer(chain).spill_all()[1] == 0, "every chunk and state is on disk"
        finally:
            chain.close()
    assert Store.unlink(cache_name)
    restarted = engine("after-restart", cfg)
    r = restarted.generate([P])
    assert r["num_cached_tokens"] == [HIT] and r["outputs"] == want
    with Store.attach(cache_name) as s:
        assert s.stats()["disk_hit_tokens"] == HIT
    restarted.close()

    # a chunk gone between lookup and load (another engine's eviction): the load of this
    # engine of two KV-cache groups fails as a request, and vLLM recomputes it, not stopping
    evicted = engine("evicted-before-load", cfg, env={EVICT_BEFORE_LOAD: "1"},
                     llm_kwargs={"disable_log_stats": False})
    r = evicted.generate([P])
    assert r["outputs"] == want
    assert f"TEST SWITCH {EVICT_BEFORE_LOAD}='1' is on" in open(evicted.log_path).read()
    assert evicted.metrics().get("vllm:shmkv_load_failed_blocks", 0) > 0, "the load did fail"
    assert evicted.generate([P])["outputs"] == want, "the engine serves on"
