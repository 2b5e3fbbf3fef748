"""The narrowest host grant: segments in a directory of their own
(SHMKV_SEGMENT_DIR: a tmpfs, 0700, of the cache's uid), so a container
mounts that one directory instead of the host's /dev/shm or IPC namespace;
its parents must be directories no other user can change.
Containers here are `unshare --pid --fork --mount-proc` with a private
/dev/shm mounted over the host's: only the segment directory is shared."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from helpers import helpers_env, key, payload_for, wait_until

from shmkv import PutResult, Store
from shmkv.errors import InvalidArgumentError, PermissionDeniedError, SegmentNotFoundError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs and namespaces need root, as in CI")

@pytest.fixture
def segment_dir(tmp_path, monkeypatch):
    """A dedicated tmpfs (what a hostPath of a host tmpfs gives a pod), 0700, named in this process's environment."""
    d = tmp_path / "segments"
    d.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,mode=0700", "shmkv-segments", str(d)], check=True)
    monkeypatch.setenv("SHMKV_SEGMENT_DIR", str(d))
    yield str(d)
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_segment_lives_in_the_directory_and_nowhere_else(segment_dir, cache_name):
    with Store.create(cache_name, 8 << 20, populate=False) as s:
        assert s.put(key(1), payload_for(key(1), 4096)) is PutResult.OK
        st = os.stat(os.path.join(segment_dir, cache_name))
        assert st.st_mode & 0o777 == 0o600
        assert not os.path.exists(f"/dev/shm/{cache_name}"), "nothing in the host's /dev/shm"
        with Store.attach(cache_name, populate=False) as t:
            assert bytes(t.get(key(1))) == payload_for(key(1), 4096)
    assert Store.unlink(cache_name)
    assert not os.path.exists(os.path.join(segment_dir, cache_name))


@pytest.mark.parametrize("bad", ["group-readable", "not-tmpfs", "relative", "missing"])
def test_a_directory_that_is_not_safe_memory_is_refused_naming_it(cache_name, tmp_path, monkeypatch, bad):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    if bad == "group-readable":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0750", "shmkv-segments", str(d)], check=True)
    path = {"relative": "segments", "missing": str(tmp_path / "nowhere")}.get(bad, str(d))
    monkeypatch.setenv("SHMKV_SEGMENT_DIR", path)
    expected = {"group-readable": PermissionDeniedError, "not-tmpfs": InvalidArgumentError,
                "relative": InvalidArgumentError, "missing": SegmentNotFoundError}[bad]
    try:
        with pytest.raises(expected, match=re.escape("segment_dir=" + path)):
            Store.create(cache_name, 8 << 20, populate=False)
    finally:
        if bad == "group-readable":
            subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_directory_under_a_parent_others_can_change_is_refused(cache_name, tmp_path, monkeypatch):
    """Whoever can change a parent can swap the directory between two opens:
    the segment directory must hang below directories no other user can change."""
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)  # writable by everyone, not sticky
    d = parent / "segments"
    d.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "shmkv-segments", str(d)], check=True)
    monkeypatch.setenv("SHMKV_SEGMENT_DIR", str(d))
    try:
        with pytest.raises(PermissionDeniedError, match=re.escape(f"segment_dir={d}: {parent}: ")):
            Store.create(cache_name, 8 << 20, populate=False)
        assert os.listdir(d) == [], "refused before anything is created"
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_link_planted_at_the_segments_name_is_refused(segment_dir, cache_name, tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, os.path.join(segment_dir, cache_name))
    with pytest.raises(PermissionDeniedError):
        Store.attach(cache_name, populate=False)


HOLDER = """
import sys
from helpers import key, payload_for
from shmkv import Store
s = Store.attach({name!r}, populate=False)
lease = s.acquire(key(1))
view = bytes(lease.view())
print("held", flush=True)
sys.stdin.readline()
print("lease", bytes(lease.view()) == view, lease.release(), flush=True)
"""

OTHER = """
import os
from helpers import key, payload_for
from shmkv import Store
print("own-shm", os.listdir("/dev/shm") == [], flush=True)
s = Store.attach({name!r}, populate=False)
print("got", bytes(s.get(key(1))) == payload_for(key(1), 1 << 20), flush=True)
print("reclaimed", s.reclaim()["leases"], flush=True)
"""


def test_containers_sharing_only_the_segment_directory_share_the_cache(segment_dir, cache_name, child):
    """Two containers, each with its own PID namespace and its own /dev/shm:
    B reads what the host stored, A's live lease is never reclaimed by B,
    and once A is killed its lease is reclaimed."""
    env = helpers_env(SHMKV_SEGMENT_DIR=segment_dir)
    with Store.create(cache_name, 16 << 20, populate=False) as s:
        assert s.put(key(1), payload_for(key(1), 1 << 20)) is PutResult.OK
        a = child(HOLDER.format(name=cache_name), pid_namespace=True, private_shm=True, env=env)
        a.expect("held")
        b = child(OTHER.format(name=cache_name), pid_namespace=True, private_shm=True, env=env)
        assert b.expect("own-shm") == "own-shm True", "the container's /dev/shm is its own"
        assert b.expect("got") == "got True"
        assert b.expect("reclaimed") == "reclaimed 0"
        b.finish()
        a.proc.stdin.write("go\n")
        a.proc.stdin.flush()
        assert a.expect("lease") == "lease True True"
        a.finish()
        a = child(HOLDER.format(name=cache_name), pid_namespace=True, private_shm=True, env=env)
        a.expect("held")
        a.kill9()
        wait_until(lambda: s.stats()["processes_attached"] == 1, "the killed container's process exited")
        assert s.reclaim()["leases"] == 1


def test_one_process_opens_two_caches_in_two_directories(cache_name, tmp_path, monkeypatch):
    """The directory is an argument, not this process's environment: two
    caches of the same name in two directories (and one in /dev/shm) are
    three segments, each opened, read and removed through its own directory,
    whatever SHMKV_SEGMENT_DIR says meanwhile."""
    dirs = []
    for n in ("a", "b"):
        d = tmp_path / n
        d.mkdir(mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "shmkv-segments", str(d)], check=True)
        dirs.append(str(d))
    monkeypatch.setenv("SHMKV_SEGMENT_DIR", str(tmp_path / "nowhere"))  # what a call naming its directory ignores
    try:
        stores = [Store.create(cache_name, 8 << 20, populate=False, segment_dir=d) for d in (*dirs, "")]
        try:
            for i, s in enumerate(stores):
                assert s.put(key(1), payload_for(key(i), 4096)) is PutResult.OK
            for i, d in enumerate((*dirs, "")):
                assert os.stat(os.path.join(d or "/dev/shm", cache_name)).st_mode & 0o777 == 0o600
                with Store.attach(cache_name, populate=False, segment_dir=d) as t:
                    assert t.segment_dir == d and bytes(t.get(key(1))) == payload_for(key(i), 4096), d
        finally:
            for s in stores:
                s.close()
        for d in (*dirs, ""):
            assert Store.unlink(cache_name, segment_dir=d)
            assert not os.path.exists(os.path.join(d or "/dev/shm", cache_name))
        with pytest.raises(SegmentNotFoundError, match=re.escape(f"segment_dir={tmp_path / 'nowhere'}")):
            Store.attach(cache_name, populate=False)  # no directory named: the setting's (the environment's)
    finally:
        for d in dirs:
            subprocess.run(["umount", "-l", d], check=False)
