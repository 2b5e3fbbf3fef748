"""The disk tier directory: permissions, byte cap, damage handling, write
faults, leftover temporary files and the start-up index rebuild."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import subprocess

import pytest

from shmkv.tiers import format as fmt
from shmkv.tiers.disk import tier as tier_mod
from shmkv.tiers.disk.tier import DiskTier

NS = b"n" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


@pytest.fixture
def counts():
    c: dict[str, int] = {}
    return c


def make(tmp_path, counts, cap=1 << 30) -> DiskTier:
    return DiskTier(str(tmp_path / "disk"), capacity_bytes=cap,
                    counter=lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n))


def test_files_0600_in_a_0700_directory_whatever_the_umask(tmp_path, counts):
    old = os.umask(0)
    try:
        t = make(tmp_path, counts)
        assert t.write(key(1), NS, b"abc" * 1000)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(t.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(t.path(key(1))).st_mode) == 0o600


def test_write_read_contains(tmp_path, counts):
    t = make(tmp_path, counts)
    raw = os.urandom(10_000)
    assert t.write(key(1), NS, raw, tokens=256)
    assert t.read(key(1)) == raw
    assert t.fetch(key(1)) == (raw, NS)
    assert t.contains([key(1), key(2)]) == [True, False]
    assert t.prefix_length([key(1), key(2), key(1)]) == 1
    assert t.read(key(2)) is None
    assert counts == {"spills": 1, "spill_bytes": 10_000, "spill_tokens": 256}


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "foreign"])
def test_damaged_file_is_a_miss_a_counter_and_removed(tmp_path, counts, damage):
    t = make(tmp_path, counts)
    t.write(key(1), NS, os.urandom(5000))
    p = t.path(key(1))
    data = open(p, "rb").read()
    bad = {"truncate": data[:-10], "flip": data[:100] + bytes([data[100] ^ 0xFF]) + data[101:],
           "empty": b"", "foreign": b"#!/bin/sh\necho hello\n"}[damage]
    open(p, "wb").write(bad)
    assert t.read(key(1)) is None
    assert counts.get("disk_damaged") == 1
    assert not os.path.exists(p)


def test_write_errors_are_counted_not_raised(tmp_path, counts, monkeypatch):
    t = make(tmp_path, counts)

    def disk_full(fd, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tier_mod.os, "writev", disk_full)
    assert t.write(key(1), NS, b"x" * 100) is False
    monkeypatch.undo()
    assert counts.get("spill_errors") == 1
    assert os.listdir(t.dir) == [], "no temporary file is left behind"


def _exited_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_rebuild_removes_temp_files_and_reads_no_bodies(tmp_path, counts, monkeypatch):
    t = make(tmp_path, counts)
    for i in range(5):
        t.write(key(i), NS, os.urandom(2000))
    dead = _exited_pid()
    open(os.path.join(t.dir, f".{key(9).hex()}.{dead}.77.tmp"), "wb").write(b"half, of a killed writer")
    live = os.path.join(t.dir, f".{key(8).hex()}.{dead}.78.tmp")
    writing = os.open(live, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(writing, b"half, of a writer that still runs")
    # its flock says it still writes (its pid, another container's perhaps, says nothing)
    fcntl.flock(writing, fcntl.LOCK_EX)
    open(os.path.join(t.dir, "README"), "w").write("not ours")

    def no_decode(*a, **k):
        raise AssertionError("the index rebuild must not decompress")

    monkeypatch.setattr(fmt, "decode", no_decode)
    t2 = make(tmp_path, counts)
    try:
        files, size = t2.rebuild_index()
    finally:
        os.close(writing)
    assert files == 5 and size == sum(os.path.getsize(t2.path(key(i))) for i in range(5))
    assert [n for n in os.listdir(t2.dir) if n.endswith(".tmp")] == [os.path.basename(live)], \
        "a dead writer's temporary file goes; a live writer's stays"
    assert os.path.exists(os.path.join(t2.dir, "README")), "foreign files are left alone"


def test_byte_cap_removes_least_recently_used_files(tmp_path, counts):
    t = make(tmp_path, counts, cap=1)  # set after measuring one file
    t.rebuild_index()
    t.capacity = 10**9
    raw = os.urandom(3000)
    t.write(key(0), NS, raw)
    one = os.path.getsize(t.path(key(0)))
    t.capacity = 3 * one
    for i in range(1, 4):
        t.write(key(i), NS, raw)
    assert t.contains([key(i) for i in range(4)]) == [False, True, True, True]
    t.read(key(1))  # key 1 becomes most recent
    t.write(key(4), NS, raw)
    assert t.contains([key(i) for i in range(5)]) == [False, True, False, True, True]
    assert counts.get("disk_removed") == 2
    assert t.used_bytes <= t.capacity
