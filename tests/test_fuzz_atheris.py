"""Coverage-guided fuzz runs (atheris / libFuzzer, scripts/fuzz.py) of the
chunk-format parser and the controller, bounded for CI. Skipped with a reason
where atheris does not install."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

pytest.importorskip("atheris", reason="atheris is not installed here (scripts/setup.sh installs it where it can)")
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("target,runs", [("disk_format", 30000), ("controller", 5000)])
def test_fuzz_target(target, runs, tmp_path):
    r = subprocess.run([sys.executable, "scripts/fuzz.py", target, f"-runs={runs}", "-max_len=2048", "-seed=1",
                        f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"Done {runs} runs" in r.stderr, r.stderr[-2000:]
