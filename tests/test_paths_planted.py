"""Directories another user planted are refused, naming the path and its
owner; nothing in them is changed (no chmod, no deletion). Runs the planting
as `nobody` (needs root and setpriv)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

from shmkv.errors import PermissionDeniedError
from shmkv.paths import PrivateDir, open_private_dir, runtime_dir
from shmkv.tiers.disk.tier import DiskTier

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                reason="switching to another user needs root and setpriv")


def as_nobody(code: str, *args: str) -> None:
    r = subprocess.run([SETPRIV, "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/bin/sh", "-c", code,
                        "sh", *args], capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 0, r.stderr


def test_planted_parent_is_refused_and_left_alone(sticky_tmp):
    parent, victim = os.path.join(sticky_tmp, "P"), os.path.join(sticky_tmp, "R")
    os.mkdir(victim, 0o755)
    open(os.path.join(victim, "precious.tmp"), "w").close()
    # nobody owns P and plants P/<cache> -> R (root's directory)
    as_nobody('mkdir -m 0777 "$1" && ln -s "$2" "$1/shmkv-x"', parent, victim)
    with pytest.raises(PermissionDeniedError, match=f"{parent}: owned by uid 65534"):
        DiskTier(os.path.join(parent, "shmkv-x"), capacity_bytes=1 << 20)
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755, "not chmod'ed"
    assert os.path.exists(os.path.join(victim, "precious.tmp")), "nothing deleted"


def test_symlinked_leaf_of_another_user_is_refused(sticky_tmp):
    victim = os.path.join(sticky_tmp, "R")
    os.mkdir(victim, 0o755)
    leaf = os.path.join(sticky_tmp, "disk")
    as_nobody('ln -s "$2" "$1"', leaf, victim)
    with pytest.raises(PermissionDeniedError, match="symbolic link owned by uid 65534"):
        open_private_dir(leaf)
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o755


def test_our_own_links_are_followed(sticky_tmp):
    real = os.path.join(sticky_tmp, "real")
    os.mkdir(real, 0o700)
    os.symlink(real, os.path.join(sticky_tmp, "link"))
    d = open_private_dir(os.path.join(sticky_tmp, "link", "disk"))
    assert isinstance(d, PrivateDir) and d.path == os.path.join(real, "disk")
    assert stat.S_IMODE(os.stat(d.path).st_mode) == 0o700
    d.close()


def test_a_planted_runtime_directory_is_refused_with_the_fix(sticky_tmp, monkeypatch):
    planted = os.path.join(sticky_tmp, "shmkv-0")
    as_nobody('mkdir -m 0777 "$1"', planted)
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", planted)
    with pytest.raises(PermissionDeniedError, match="owned by uid 65534") as e:
        runtime_dir()
    assert "SHMKV_RUNTIME_DIR" in str(e.value), "the message names the fix"
    # the daemon says the same in one line (no traceback) and exits non-zero
    env = dict(os.environ, SHMKV_RUNTIME_DIR=planted)
    r = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--cache", "shmkv-planted-test", "--capacity",
                        "8MiB", "--listen", "127.0.0.1:0"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "65534" in r.stderr, r.stderr


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o703])
def test_our_directory_that_others_can_write_is_refused_not_chmodded(sticky_tmp, mode):
    d = os.path.join(sticky_tmp, "disk", "shmkv-x")
    os.makedirs(d)
    os.chmod(d, mode)
    if mode & 0o002:  # what makes such a directory dangerous: anyone could have put a chunk there
        as_nobody('printf planted > "$1/00000000000000000000000000000000.kv"', d)
    with pytest.raises(PermissionDeniedError) as e:
        DiskTier(d, capacity_bytes=1 << 20)
    assert d in str(e.value) and "writable by group or others" in str(e.value) and f"chmod 700 {d}" in str(e.value)
    assert stat.S_IMODE(os.stat(d).st_mode) == mode, "left as it was: the owner checks it first"


def test_a_chunk_file_of_another_user_is_removed_and_counted(sticky_tmp):
    from helpers import key

    from shmkv.tiers import format as fmt

    d = os.path.join(sticky_tmp, "disk", "shmkv-x")
    counts: dict[str, int] = {}
    tier = DiskTier(d, capacity_bytes=1 << 30, counter=lambda n, k: counts.__setitem__(n, counts.get(n, 0) + k))
    k = key(7)
    assert tier.write(k, b"N" * 16, b"\x01" * 4096)
    os.chown(tier.path(k), 65534, 65534)  # as if another uid had written it (a well-formed chunk)
    assert fmt.decode(open(tier.path(k), "rb").read(), k)[0] == b"\x01" * 4096
    assert tier.fetch(k) is None
    assert counts.get("disk_damaged") == 1 and not os.path.exists(tier.path(k))
