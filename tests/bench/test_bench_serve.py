"""`python -m shmkv.bench serve --json` with a small workload: vLLM's own
client against `vllm serve`, every arm on fresh servers, vLLM alone and with
shmkv. Its timings are the benchmark's to report; what is asserted is what
the servers' counters say: the controls hold (shmkv loads nothing where
there is nothing to reuse, vLLM's own cache serves the reuse it holds), and
shmkv served the evicted, restarted and other-server prefixes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_serve_benchmark_runs(tmp_path):
    plot = tmp_path / "serve.png"
    # NOTE: a capacity of its own: the default (a quarter of /dev/shm) beside the other tests' engines
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "serve", "--small", "--capacity", "256MiB", "--json",
                        "--workdir", str(tmp_path), "--plot", str(plot)],
                       capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    arms = got["arms"]
    assert {a: sorted(v) for a, v in arms.items()} == {
        "no_reuse": ["shmkv", "vllm"], "in_cache": ["shmkv", "vllm"], "evicted": ["shmkv", "vllm"],
        "restart": ["shmkv", "vllm"], "round_robin": ["shmkv", "vllm"], "budget": ["shared", "split"]}
    assert got["controls"]["no_reuse"]["ok"] and got["controls"]["in_cache"]["ok"], got["controls"]
    assert "failed" not in got
    assert got["server_starts"] == 8, "--small: the one-server arms share a server, restart's fresh one and budget's " \
        "shared pair are the round-robin pair's"
    prefix = got["workload"]["prefix_tokens"]
    for arm in ("evicted", "restart"):
        assert arms[arm]["shmkv"]["shmkv_loaded_tokens"] == arms[arm]["shmkv"]["requests"] * prefix, arm
        assert arms[arm]["vllm"]["vllm_cache_tokens"] == 0, f"{arm}: nothing left in vLLM's own cache"
        assert arms[arm]["vllm"]["shmkv_loaded_tokens"] == 0
    assert arms["round_robin"]["shmkv"]["shmkv_loaded_tokens"] > 0, "the other server's prefixes came from shmkv"
    assert arms["round_robin"]["shmkv"]["per_server_requests"] == arms["round_robin"]["vllm"]["per_server_requests"]
    assert arms["budget"]["shared"]["shmkv_loaded_tokens"] > arms["budget"]["split"]["shmkv_loaded_tokens"]
    assert set(got["goals"]) == {"evicted", "restart", "round_robin"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
