"""`bench hostpath` runs to its end on a small hit and says each host time
(the figures themselves are the benchmark's, not this test's)."""

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
    assert out["choice_walk_first_layer_us_per_unit"] > 0 and out["choice_walk_every_layer_us_per_unit"] > 0
