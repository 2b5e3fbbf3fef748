"""Two vLLM OpenAI servers (what `vllm serve` runs, CPU backend, random-weight
model, loopback ports) configured by the plugin name alone: a prompt the
first served is a hit in the second, which answers as the first does at the
same split; the second's /metrics shows the hit tokens; and
/reset_prefix_cache?reset_external=true makes the next request miss."""

from __future__ import annotations

import pytest
from helpers import ServeProcess, random_prompt

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=71)


def test_two_servers_share_the_cache(cache_name, model_dir, engine_logs):
    ktc = {"kv_connector": "ShmKVConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cache_name": cache_name, "capacity": "256MiB"}}
    servers = []
    try:
        a = ServeProcess(model_dir, ktc, str(engine_logs / "serve-a.log"))
        servers.append(a)
        a.complete(P)  # cold: computes and stores 896 tokens
        assert a.metric(f'vllm:shmkv_stored_tokens_total{{engine="0",model_name="{model_dir}"}}') == 896
        at_split = a.complete(P)  # a hit of 896 from shmkv: the split the second server will use
        b = ServeProcess(model_dir, ktc, str(engine_logs / "serve-b.log"))
        servers.append(b)
        host = f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="{model_dir}",source="host"}}'
        assert b.complete(P) == at_split
        assert b.metric(host) == 896

        b.post("/reset_prefix_cache?reset_external=true")
        b.complete(P)
        assert b.metric(host) == 896, "after the reset the prompt misses"
    finally:
        for s in servers:
            s.close()
