"""Two vLLM OpenAI servers (what `vllm serve` runs, CPU backend, random-weight
model, loopback ports) configured by the plugin name alone: a prompt the
first served is a hit in the second, which answers as the first does at the
same split; the second's /metrics shows the hit tokens;
/reset_prefix_cache?reset_external=true removes nothing shared (the next
request still hits: clearing is the operator's act); and a
kv_load_failure_policy given on the command line is kept (shmkv's default,
recompute, applies only where none was given). The first server's EngineCore
and worker start as `vllm serve` starts them on a CPU host (spawned), the
second's forked as on a GPU host."""

from __future__ import annotations

import pytest
from helpers import ServeProcess, check_runner, random_prompt, runner_env

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=71)


def test_two_servers_share_the_cache(cache_name, model_dir, engine_logs, vllm_runner):
    ktc = {"kv_connector": "ShmKVConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cache_name": cache_name, "capacity": "256MiB"}}
    servers = []
    try:
        env = runner_env(vllm_runner)
        a = ServeProcess(model_dir, ktc, str(engine_logs / f"serve-a-{vllm_runner}.log"), env=env)
        servers.append(a)
        check_runner(a.log.name, vllm_runner)
        a.complete(P)  # cold: computes and stores 896 tokens
        assert a.metric(f'vllm:shmkv_stored_tokens_total{{engine="0",model_name="{model_dir}"}}') == 896
        at_split = a.complete(P)  # a hit of 896 from shmkv: the split the second server will use
        b = ServeProcess(model_dir, {**ktc, "kv_load_failure_policy": "fail"},
                         str(engine_logs / f"serve-b-{vllm_runner}.log"), env=env, forked=True)
        servers.append(b)
        host = f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="{model_dir}",source="host"}}'
        assert b.complete(P) == at_split
        assert b.metric(host) == 896

        b.post("/reset_prefix_cache?reset_external=true")
        assert b.complete(P) == at_split
        assert b.metric(host) == 2 * 896, "a connector reset removes nothing: the prompt still hits"

        log_a = (engine_logs / f"serve-a-{vllm_runner}.log").read_text(errors="replace")
        log_b = (engine_logs / f"serve-b-{vllm_runner}.log").read_text(errors="replace")
        assert "set kv_load_failure_policy=recompute" in log_a, "nothing given: shmkv's default"
        assert "kv_load_failure_policy=fail as given on the command line (kept)" in log_b
        assert "set kv_load_failure_policy=recompute" not in log_b
    finally:
        for s in servers:
            s.close()
