"""`python -m shmkv.stats` in each output format, and without a segment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO, key

from shmkv import Store


def stats(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmkv.stats", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120)


@pytest.fixture
def busy_store(cache_name, tmp_path):
    s = Store.create(cache_name, 8 << 20, alignment=256)
    for i in range(5):
        s.put(key(i), b"x" * 1000)
    s.get(key(0))
    s.get(key(99))
    s.pin(key(1))
    (tmp_path / "disk" / cache_name).mkdir(parents=True)
    (tmp_path / "disk" / cache_name / (key(7).hex() + ".kv")).write_bytes(b"z" * 100)
    yield s, str(tmp_path / "disk")
    s.close()


def test_json(busy_store, cache_name):
    _, disk = busy_store
    r = stats("--cache", cache_name, "--json", "--disk-dir", disk)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    shm = snap["shm"]
    assert snap["cache"] == cache_name
    assert shm["puts"] == 5 and shm["hits"] == 1 and shm["lookups"] == 2 and shm["hit_rate"] == 0.5
    assert shm["entries"] == 5 and shm["pinned_entries"] == 1 and shm["bytes_used"] == 5 * 1024
    assert shm["processes_attached"] == 1, "the test process; the stats process does not count itself"
    assert snap["disk"]["files"] == 1 and snap["disk"]["bytes_on_disk"] == 100


def test_table(busy_store, cache_name):
    r = stats("--cache", cache_name)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert f"shmkv cache '{cache_name}'" in out
    assert "hit rate          50.0% (1 hits / 2 lookups)" in out
    assert "entries           5 (1 pinned" in out
    assert "shared tier" in out and "disk tier" in out


def test_prometheus(busy_store, cache_name):
    r = stats("--cache", cache_name, "--prometheus")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# HELP shmkv_hits_total Chunks found per tier" in out
    assert "# TYPE shmkv_hits_total counter" in out
    assert f'shmkv_hits_total{{cache="{cache_name}",tier="shm"}} 1.0' in out
    assert f'shmkv_bytes_used{{cache="{cache_name}",tier="shm"}} 5120.0' in out
    assert f'shmkv_puts_total{{cache="{cache_name}",tier="disk"}} 0.0' in out


def test_watch_repeats(busy_store, cache_name):
    r = stats("--cache", cache_name, "--json", "--watch", "0.05", "--count", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 and all(json.loads(x)["cache"] == cache_name for x in lines)


def test_without_a_segment_says_what_it_looked_for(cache_name):
    r = stats("--cache", cache_name)
    assert r.returncode == 1
    assert f"no cache named '{cache_name}'" in r.stderr and f"/dev/shm/{cache_name}" in r.stderr
    assert "start_shm_daemon.sh" in r.stderr and "--cache NAME" in r.stderr


def test_bad_arguments():
    r = stats("--watch", "0")
    assert r.returncode == 2 and "positive" in r.stderr


def test_a_disk_dir_that_is_not_one_is_refused_by_name(busy_store, cache_name, tmp_path):
    _, disk_dir = busy_store
    r = stats("--cache", cache_name, "--disk-dir", "/etc/passwd")
    assert r.returncode == 2 and "--disk-dir /etc/passwd: not a directory" in r.stderr
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / cache_name).write_text("not chunks")
    r = stats("--cache", cache_name, "--disk-dir", str(tmp_path / "files"))
    assert r.returncode == 2 and "is not a directory of disk-tier chunks" in r.stderr
    r = stats("--cache", cache_name, "--disk-dir", disk_dir, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["disk"]["files"] == 1
