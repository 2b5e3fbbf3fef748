"""`pytest -m gpu` on a host with a CUDA GPU but no shmkv._C_cuda (built where
no nvcc was found) must fail naming the fix, never pass by skipping every
test. Simulated here: torch reports a GPU, and _C_cuda does not import."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO

RUN = """
import sys
import torch
torch.cuda.is_available = lambda: True
sys.modules["shmkv._C_cuda"] = None  # import fails, as in a build without nvcc
import pytest
# in this process (-n 0): the simulated GPU and build are this interpreter's
sys.exit(pytest.main(["-m", "gpu", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/transfer/test_kernels_cuda.py"]))
"""


def test_gpu_tests_fail_on_a_gpu_host_without_the_cuda_build():
    r = subprocess.run([sys.executable, "-c", RUN], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0, r.stdout[-2000:]
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if "a CUDA GPU is here but" in ln]
    assert len(lines) == 1, out[-3000:]
    assert "shmkv was built without its CUDA part" in lines[0] and "pip install --no-build-isolation" in lines[0]
    assert " passed" not in out
