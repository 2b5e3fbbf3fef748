"""Small inputs that used to end in a traceback: each now gets the clean error
a user can act on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import REPO

from shmkv import Store
from shmkv.config import load_config
from shmkv.errors import ConfigError, InvalidArgumentError


@pytest.mark.parametrize("capacity", [-1, 0, 1 << 64, "8GiB", 2.5, True])
def test_store_create_refuses_a_bad_capacity_by_name(cache_name, capacity):
    with pytest.raises(InvalidArgumentError, match="capacity_bytes"):
        Store.create(cache_name, capacity)


def test_store_create_refuses_a_bad_geometry_field(cache_name):
    with pytest.raises(InvalidArgumentError, match="max_payload_bytes"):
        Store.create(cache_name, 8 << 20, max_payload_bytes=-1)


def test_capacity_of_2_to_the_64_is_a_config_error():
    with pytest.raises(ConfigError, match="capacity"):
        load_config({"capacity": str(1 << 64)}, env={})


def test_daemon_exits_2_on_a_huge_capacity():
    r = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--capacity", "18446744073709551616",
                        "--cache", "shmkv-huge-test"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "capacity" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_stats_on_a_symlink_loop_says_so(cache_name):
    path = f"/dev/shm/{cache_name}"
    os.symlink(path, path)  # a link to itself: ELOOP
    try:
        r = subprocess.run([sys.executable, "-m", "shmkv.stats", "--cache", cache_name], capture_output=True,
                           text=True, timeout=120, cwd=REPO)
    finally:
        os.unlink(path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and cache_name in r.stderr, r.stderr
