"""Something that is not a regular file under a chunk's name (a FIFO, a link
to a device, a device, a directory) is a miss and a `disk_damaged` count,
never a hang, an unbounded read or a hit that never loads. So is a regular
file longer than its header declares."""

from __future__ import annotations

import os
import stat
from collections import Counter

import pytest
from helpers import key, payload_for

from shmkv import Store
from shmkv.tiers import TierChain
from shmkv.tiers.disk.tier import DiskTier


@pytest.fixture
def tier(tmp_path):
    counts: Counter = Counter()
    t = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30, counter=lambda n, k: counts.update({n: k}))
    t.rebuild_index()
    return t, counts


def plant(t: DiskTier, k: bytes, kind: str) -> None:
    path = t.path(k)
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink_to_dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero's numbers
        except PermissionError:
            pytest.skip("creating a device node needs CAP_MKNOD")
    elif kind == "directory":
        os.mkdir(path, 0o700)


@pytest.mark.parametrize("kind", ["fifo", "symlink_to_dev_zero", "device", "directory"])
def test_special_file_is_a_counted_miss(tier, kind):
    t, counts = tier
    plant(t, key(1), kind)
    assert t.contains([key(1)]) == [False]
    assert t.read(key(1)) is None  # returns at once: a FIFO with no writer would block a plain open
    assert t.prefix_length([key(1)]) == 0
    assert counts["disk_damaged"] == 1, "counted once, whatever the number of lookups"
    if kind != "directory":
        assert not os.path.lexists(t.path(key(1))), "removed"
    assert t.rebuild_index() == (0, 0)


def test_promotion_past_a_fifo_does_not_hang(tier, cache_name):
    t, counts = tier
    store = Store.create(cache_name, 8 << 20, populate=False)
    assert t.write(key(0), b"N" * 16, payload_for(key(0), 8192))
    plant(t, key(1), "fifo")
    assert TierChain(store, [t]).promote([key(0), key(1)], [b"N" * 16] * 2) == 1, "stops at the FIFO, a miss"
    assert store.get(key(0)) == payload_for(key(0), 8192)


def test_a_file_longer_than_its_header_says_is_damaged(tier):
    t, counts = tier
    assert t.write(key(2), b"N" * 16, payload_for(key(2), 8192))
    with open(t.path(key(2)), "ab") as f:
        f.write(b"\0" * (1 << 20))
    assert t.read(key(2)) is None
    assert counts["disk_damaged"] == 1 and not os.path.exists(t.path(key(2)))
