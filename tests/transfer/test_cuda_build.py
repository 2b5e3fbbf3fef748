"""The CUDA part as built here (nvcc found: CI compiles it in every run)
carries machine code for every GPU users run (Ampere to Blackwell) and PTX
for newer ones, loads on a host with no GPU and no driver (it needs the CUDA
runtime, never libcuda, to import), and `pytest -m gpu` on such a host skips
with its reason instead of failing."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

REQUIRED = {"80-real", "86-real", "89-real", "90-real", "100-real", "120-real", "120-virtual"}
NO_DRIVER = not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl"))

built = pytest.mark.skipif(
    importlib.util.find_spec("shmkv._C_cuda") is None,
    reason="shmkv was built without its CUDA part here (no nvcc at install time)")


@built
def test_every_gpu_users_run_is_compiled_for():
    from shmkv import _C_cuda

    assert set(_C_cuda.ARCHITECTURES.split()) >= REQUIRED, _C_cuda.ARCHITECTURES
    assert _C_cuda.CUDA_RUNTIME_BUILT >= 12080, "sm_100 and sm_120 need CUDA 12.8 or newer"


@built
def test_the_cuda_part_imports_without_a_driver_and_never_links_libcuda():
    from shmkv import _C_cuda

    r = subprocess.run([sys.executable, "-c", "import shmkv._C_cuda as c; print(c.ARCHITECTURES)"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0 and "90-real" in r.stdout, r.stderr[-2000:]
    ldd = shutil.which("ldd")
    if ldd is None:
        pytest.skip("no ldd to list what the module links")
    needed = subprocess.run([ldd, _C_cuda.__file__], capture_output=True, text=True).stdout
    assert "libcudart" in needed and "libcuda.so" not in needed, needed


@pytest.mark.skipif(not NO_DRIVER, reason="an NVIDIA driver is here: `pytest -m gpu` runs its tests")
def test_gpu_tests_skip_with_their_reason_where_there_is_no_gpu():
    r = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "-rs", "-p",
                        "no:cacheprovider", "tests/transfer/test_kernels_cuda.py"],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert " skipped" in out and " passed" not in out and " failed" not in out, out[-3000:]
    assert "no CUDA GPU" in out, out[-3000:]
