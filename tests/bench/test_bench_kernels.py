"""`bench kernels` runs to its end on this machine (the CPU case; the GPU
case says why it is skipped) and closes every segment it made."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import REPO


def test_the_kernels_benchmark_runs():
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "kernels", "--layers", "2", "--blocks", "8",
                        "--repeats", "2", "--json"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    cpu = out["cpu"] if "cpu" in out else out
    assert cpu["gather_gbps"] > 0 and cpu["scatter_gbps"] > 0, out
