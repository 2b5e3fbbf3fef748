"""`python -m shmkv.bench trace --json` on a small slice of the production
trace (4 conversations, the small model): vLLM's own client replays it
through two `vllm serve` behind the round-robin proxy with one shared
segment, and LMCache's server where its environment exists (left out with
the reason elsewhere, as on CI). Timings are the benchmark's to report; what
is asserted is what the servers' counters say against the slice's ceilings:
shmkv serves at least 90 % of what an LRU cache of its budget could, past
what vLLM's own cache served. The vLLM-alone arm is left out here (two
server starts): its control, no connector tokens without shmkv, is
test_bench_concurrency's and test_bench_serve's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

# the workspace's copy of the production trace, beside the checkout (shared/traces/README.md)
TRACE = os.path.join(os.path.dirname(REPO), "shared", "traces", "mooncake_conversation_trace.jsonl")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(TRACE),
                                 reason=f"the production trace is not at {TRACE} (shared/traces)")]


def test_the_trace_replay_serves_what_its_budget_allows(tmp_path):
    # NOTE: one request at a time: which turn overlaps which (and so what is stored before it is
    # asked again) would otherwise depend on timing
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "trace", "--trace", TRACE, "--small",
                        "--conversations", "4", "--arms", "shmkv,lmcache", "--max-concurrency", "1",
                        "--max-output", "8", "--json", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    c, arms = got["ceilings"], got["arms"]
    assert got["requests"] == arms["shmkv"]["per_server_requests"][0] + arms["shmkv"]["per_server_requests"][1]
    assert "vllm" not in arms and arms["shmkv"]["prompt_tokens"] == c["prompt_tokens"], "the slice's prompts"
    assert 0 < c["lru_budget_chunk"] <= c["unlimited_chunk"] <= c["unlimited_vllm_block"] < c["prompt_tokens"]
    s = arms["shmkv"]
    assert s["connector_tokens"] >= 0.9 * (c["lru_budget_chunk"] - s["vllm_cache_tokens"]), (s, c)
    assert s["reused_tokens"] <= c["unlimited_vllm_block"], "nothing is reused beyond what any cache could serve"
    if "lmcache" in got["left_out"]:
        assert "--with-lmcache" in got["left_out"]["lmcache"], "the reason names how to run the arm"
    else:
        m = arms["lmcache"]
        assert m["prompt_tokens"] == c["prompt_tokens"] and m["connector_tokens"] > 0, m
