"""`python -m shmkv.bench weights-digest --json` runs on a small size: one
row per device, kernel (xxh3, the device hash) and thread count, each with its spread and the projections
for an 8B model and a 70B shard (its figures are the benchmark's to
report); the digest of the same tensors never differed between runs (the
benchmark fails if it does)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_digest_benchmark_reports_every_thread_count():
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "weights-digest", "--json", "--gib", "0.0625",
                        "--tensor-mib", "8", "--threads", "1,2", "--repeats", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    cpu = [row for row in got["rows"] if row["device"] == "cpu"]
    assert [(row["kernel"], row["threads"]) for row in cpu] == [("xxh3", 1), ("xxh3", 2), ("device", 1), ("device", 2)]
    for row in cpu:
        assert 0 < row["gb_per_s_min"] <= row["gb_per_s"] <= row["gb_per_s_max"], row
        assert row["seconds_8B (TP=1)"] > 0 and row["seconds_70B shard (TP=8)"] > 0, row
