"""`bench hostpath` runs to its end on a small hit and says each host time
(the figures themselves are the benchmark's, not this test's). It ends in an
error when the hit was not leased whole or the step's stores not reserved:
a timing of a miss is no timing of a load."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO


def test_the_hostpath_benchmark_runs():
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "hostpath", "--hit-tokens", "512", "--store-chunks",
                        "1", "--repeats", "3", "--json"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["hit_tokens"] == 512 and out["shape"]["layers"] == 32
    assert out["submit_load_us"] > 0 and out["submit_store_us"] > 0
    assert out["submit_load_every_layer_us"] > 0 and out["issue_per_layer_us"] > 0 and out["load_issue_ahead"] >= 0
    assert out["choice_walk_first_layer_us_per_unit"] > 0 and out["choice_walk_every_layer_us_per_unit"] > 0
