"""`python -m shmkv.bench concurrency --json` runs end to end on the small
model (its timings are the benchmark's to report): vLLM's own client drives
its `random` and `prefix_repetition` datasets at two concurrency levels
against vLLM alone and shmkv, and the counters hold the controls: with no
reuse shmkv stores and loads nothing, with the prefixes in vLLM's own cache
vLLM serves them and shmkv loads nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_concurrency_sweep_holds_its_controls(tmp_path):
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "concurrency", "--small", "--concurrency", "1,4",
                        "--runs", "1", "--requests", "4", "--random-tokens", "128", "--prefix-tokens", "256",
                        "--output-tokens", "4",
                        "--capacity", "256MiB",
                        "--workdir", str(tmp_path), "--json"], capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)["rows"]
    assert set(rows) == {"random@1", "random@4", "prefix_repetition@1", "prefix_repetition@4"}
    for key, row in rows.items():
        s, v = row["shmkv"], row["vllm"]
        assert s["prompt_tokens"] == v["prompt_tokens"] > 0, (key, "the same prompts for both")
        assert s["shmkv_loaded_tokens"] == s["connector_tokens"] == v["connector_tokens"] == 0, (key, s)
        if key.startswith("random"):
            assert s["shmkv_stored_tokens"] > 0 and s["vllm_cache_tokens"] == v["vllm_cache_tokens"] == 0, (key, s)
        else:
            assert s["vllm_cache_tokens"] > 0 and v["vllm_cache_tokens"] > 0, (key, s, v)
