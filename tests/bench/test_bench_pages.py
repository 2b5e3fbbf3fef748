"""`bench pages` and the page size a segment gets: in a tmpfs mounted
huge=within_size the segment's pages are huge (smaps says so) and the log
says it; in one mounted huge=never or huge=advise (its pages are reserved by
fallocate, which no advice reaches) they are 4 KiB, and the log says how to
get huge ones. The benchmark's figures are not asserted (speed lives in benchmarks)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
from helpers import REPO

from shmkv import Store
from shmkv.bench.pages_bench import _pmd_share

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root, as in CI"),
              pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage"),
                                 reason="this kernel has no transparent huge pages")]


@pytest.fixture
def tmpfs(tmp_path):
    made = []

    def mount(huge: str) -> str:
        d = tmp_path / f"huge-{huge}"
        d.mkdir(mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=256m,mode=0700,huge={huge}", "shmkv-pages", str(d)],
                       check=True)
        made.append(d)
        return str(d)

    yield mount
    for d in made:
        subprocess.run(["umount", "-l", str(d)], check=False)


@pytest.mark.parametrize("huge,expect", [("within_size", True), ("always", True), ("advise", False),
                                         ("never", False)])
def test_the_segment_gets_the_pages_its_directory_offers(tmpfs, cache_name, monkeypatch, caplog, huge, expect):
    import shmkv.store.store as store_module

    d = tmpfs(huge)
    monkeypatch.setenv("SHMKV_SEGMENT_DIR", d)
    monkeypatch.setattr(store_module, "_pages_said", set())
    with caplog.at_level(logging.INFO, logger="shmkv.store"):
        with Store.create(cache_name, 64 << 20, populate=True) as s:
            assert s.wait_reserved(timeout_s=60)
            for i in range(4):
                s.put(bytes([i]) * 16, os.urandom(8 << 20))
            share = _pmd_share(os.path.join(d, cache_name))
    Store.unlink(cache_name)
    assert (share > 0.5) is expect, share
    said = [r.getMessage() for r in caplog.records if "get huge pages" in r.getMessage() or "4 KiB" in r.getMessage()]
    assert len(said) == 1, said
    assert ("get huge pages" in said[0]) is expect and (expect or "huge=within_size" in said[0]), said


def test_the_pages_benchmark_compares_directories(tmpfs):
    dirs = [tmpfs("within_size"), tmpfs("never")]
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "pages", "--dirs", ",".join(dirs), "--size", "64",
                        "--repeats", "2", "--json"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    huge, small = json.loads(r.stdout)["dirs"]
    assert (huge["pages"], small["pages"]) == ("huge", "4 KiB")
    assert huge["pmd_mapped_share"] > 0.5 and small["pmd_mapped_share"] == 0.0
    for d in (huge, small):
        assert all(d[k] > 0 for k in ("put_gbps", "get_gbps", "gather_gbps", "scatter_gbps", "reserved_s")), d
