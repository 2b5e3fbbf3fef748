"""The chunk table's parts tested in C++ (cpp/tests/table_parts_test.cpp):
allocator coalescing, index churn, LRU order with leases, stale lease
handles, rebuild from the records, process liveness. Compiled here with the
C++ compiler that builds the extension, and run."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
from helpers import REPO


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (the extension build needs one)")
@pytest.mark.slow  # over 10 s: out of the inner loop (-m "not slow"), in CI
def test_table_parts_in_cpp(tmp_path):
    cpp = os.path.join(REPO, "cpp")
    sources = [os.path.join(cpp, "tests", "table_parts_test.cpp"), os.path.join(cpp, "chunk_table.cpp"),
               *sorted(glob.glob(os.path.join(cpp, "segment*.cpp"))), os.path.join(cpp, "process_liveness.cpp"),
               *sorted(f for f in glob.glob(os.path.join(cpp, "table_*.cpp")) if not f.endswith("_bindings.cpp"))]
    binary = str(tmp_path / "table_parts_test")
    build = subprocess.run(["c++", "-std=c++17", "-O1", "-Wall", "-Werror", "-I", cpp, *sources, "-lpthread", "-lrt",
                            "-o", binary], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([binary], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok: 0 failed checks" in run.stdout
