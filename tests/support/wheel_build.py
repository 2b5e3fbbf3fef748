"""One build of the shmkv wheel (scripts/build_wheel.sh, every CUDA
architecture: most of a minute of nvcc) per test run, shared by the tests
that install it (test_wheel.py, the V2-on-GPU bundle): the first xdist worker
to ask builds it under a lock in the run's shared temporary root, the others
wait for it and reuse it. A failed build is not cached: the next asker
builds again and sees the failure itself."""

from __future__ import annotations

import fcntl
import glob
import os
import subprocess
from dataclasses import dataclass

from helpers import REPO


@dataclass(frozen=True)
class BuiltWheel:
    path: str  # the repaired manylinux wheel
    directory: str
    log: str  # build_wheel.sh's stdout (its CUDA line names the architectures)


def shared_root(tmp_path_factory) -> str:
    """The run's temporary root every xdist worker sees (a worker's basetemp's parent)."""
    base = str(tmp_path_factory.getbasetemp())
    return os.path.dirname(base) if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_wheel(tmp_path_factory) -> BuiltWheel:
    root = shared_root(tmp_path_factory)
    out = os.path.join(root, "shmkv-wheel")
    with open(os.path.join(root, "shmkv-wheel.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        wheels = glob.glob(os.path.join(out, "shmkv-*-manylinux_*.whl"))
        log_path = os.path.join(out, "build.out")
        if not wheels or not os.path.exists(log_path):
            r = subprocess.run(["bash", os.path.join(REPO, "scripts", "build_wheel.sh"), out], capture_output=True,
                               text=True, cwd=REPO, timeout=900)
            if r.returncode != 0:
                raise AssertionError(f"scripts/build_wheel.sh failed ({r.returncode}):\n{r.stdout[-2000:]}"
                                     f"{r.stderr[-3000:]}")
            with open(log_path, "w") as f:
                f.write(r.stdout)
            wheels = glob.glob(os.path.join(out, "shmkv-*-manylinux_*.whl"))
        (wheel,) = wheels
        with open(log_path) as f:
            return BuiltWheel(wheel, out, f.read())
