"""`python -m shmkv.bench fleet --json` runs end to end with a small
workload (its figures are not asserted: they are the benchmark's to report):
every way and router answered every request, the shmkv ways avoided prefill
the prefix cache alone could not, and the restarted fleet hit the disk tier."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_the_fleet_benchmark_runs(tmp_path):
    # NOTE: a capacity of its own: the default (a quarter of /dev/shm, reserved in the background) beside
    # the other worker's engines and segments left CI's host 4.9 GiB, and an engine died without a word
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "fleet", "--small", "--conversations", "4", "--turns", "2",
                        "--system-tokens", "512", "--user-tokens", "128", "--answer-tokens", "16", "--in-process",
                        "--capacity", "256MiB", "--workdir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    ways = got["ways"]
    assert set(ways) == {"prefix/round-robin", "prefix/prefix-aware", "shmkv/round-robin", "shmkv/prefix-aware",
                         "restart/round-robin"}
    assert all(w["requests"] == 8 for w in ways.values())
    # round-robin sends a conversation's second turn to the other engine: only the shared tier has its prefix
    assert ways["shmkv/round-robin"]["prefill_tokens_avoided"] > ways["prefix/round-robin"]["prefill_tokens_avoided"]
    assert ways["restart/round-robin"]["prefill_tokens_avoided"] > 0, "hits from the disk tier after the restart"
    assert "shmkv bench fleet [" in r.stderr, "a progress bar on the terminal"
