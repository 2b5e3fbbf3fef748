"""A process group a test started through the harness and never ended
(shmkv.engines.owned_files) fails the run: at the run's end it is killed, its
files removed, and the run names where it was made (tests/support/leftovers.py).

The run is a nested pytest session with the suite's leftovers plugin, in a
mount namespace with a /dev/shm of its own, and a temporary and a runtime
directory of its own, so the other xdist worker's files do not enter its
count."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SUPPORT = os.path.join(os.path.dirname(__file__), "support")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INNER = textwrap.dedent('''
    import os, subprocess

    from shmkv.engines.owned_files import OwnedFiles


    def start(owned):
        p = subprocess.Popen(["sleep", "600"], env={**os.environ, "TMPDIR": owned.tmpdir}, start_new_session=True)
        owned.watch(p.pid)
        with open(os.environ["PIDS"], "a") as f:
            f.write(f"{p.pid}\\n")
        return p


    def test_a_harness_that_ends_its_group():
        owned = OwnedFiles("test")
        p = start(owned)
        p.kill()
        p.wait()
        owned.remove()


    def test_a_harness_that_forgets_its_group():
        start(OwnedFiles("test"))
''')


def test_a_group_never_ended_fails_the_run_and_is_ended(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root for a mount namespace with a /dev/shm of its own (unshare)")
    (tmp_path / "test_inner.py").write_text(INNER)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    pids = tmp_path / "pids"
    # a runtime directory of its own too: the other worker's engines write theirs meanwhile
    env = {**os.environ, "TMPDIR": str(private_tmp), "PIDS": str(pids), "SHMKV_RUNTIME_DIR": str(tmp_path / "run"),
           "PYTHONPATH": os.pathsep.join([SUPPORT, REPO, os.environ.get("PYTHONPATH", "")])}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_ENGINE_START_LOG", "SHMKV_TEST_UNENDED_GROUPS_LOG",
                 "SHMKV_TEST_LEFTOVERS"):
        env.pop(name, None)
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        'mount -t tmpfs -o size=64m,mode=1777 unended-test-shm /dev/shm && exec "$@"', "sh",
                        sys.executable, "-m", "pytest", "-p", "leftovers", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    out = r.stdout + r.stderr
    assert "2 passed" in out, out[-3000:]
    assert r.returncode == 1, out[-3000:]
    report = out[out.index("ENGINES NEVER ENDED"):]
    assert "test_a_harness_that_forgets_its_group" in report and "test_a_harness_that_ends_its_group" not in report
    for pid in map(int, pids.read_text().split()):
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] \
            == "Z", f"the group of {pid} was ended"
    assert os.listdir(private_tmp) == [], "its directory removed, and the run's own log"
    assert "LEFT BEHIND" not in out
