"""A full disk (a 256 KiB tmpfs): /flush says how many chunks are not on disk
and answers an error status; the maintainer backs off instead of retrying at
once, and logs one line when spilling starts failing and one when it works
again, not one per chunk."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import time

import pytest
from helpers import key

from shmkv import Store
from shmkv.config import load_config
from shmkv.services.controller import Controller
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import TierChain
from shmkv.tiers.disk.tier import DiskTier

CHUNK = 32 << 10


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def full(cache_name, small_disk):
    store = Store.create(cache_name, 8 << 20, populate=False)
    disk = DiskTier(os.path.join(small_disk, cache_name), capacity_bytes=1 << 30, counter=store.bump)
    disk.rebuild_index()
    for i in range(30):
        store.put(key(i), os.urandom(CHUNK), namespace=b"N" * 16)  # incompressible: ~7 fit
    return store, disk


def test_flush_reports_chunks_not_on_disk(full):
    store, disk = full
    cfg = load_config({"cache_name": store.name, "capacity": "8MiB"}, env={})
    ctl = Controller(cfg, store, TierChain(store, [disk]))
    status, _ctype, body = ctl.handle("POST", "/flush", b"{}")
    reply = json.loads(body)
    assert status == 507, reply
    assert 0 < reply["spilled_chunks"] < 30
    assert reply["not_on_disk"] == 30 - reply["spilled_chunks"]
    assert "No space left" in reply["error"]


def test_spill_failures_back_off_and_log_state_changes_only(full, caplog):
    store, disk = full
    m = Maintainer(TierChain(store, [disk]), spill_ahead=0.99, low_watermark=0.0)
    caplog.set_level(logging.INFO, logger="shmkv")
    t_end = time.monotonic() + 1.5
    passes = 0
    while time.monotonic() < t_end:  # as fast as a maintainer could loop
        m.run_once()
        passes += 1
    errors = store.stats()["spill_errors"]
    failing = [r for r in caplog.records if "fails" in r.getMessage()]
    assert passes > 50
    assert len(failing) == 1, [r.getMessage() for r in caplog.records]
    assert 1 <= errors <= 8, f"{errors} failed writes in 1.5 s: the backoff (0.25 s doubling) allows a few"
    # room again: the next attempt after the backoff works and says so once
    disk.clear()
    deadline = time.monotonic() + 60
    while not any("works again" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        m.run_once()
    again = [r for r in caplog.records if "works again" in r.getMessage()]
    assert len(again) == 1 and "failed attempts" in again[0].getMessage()
    assert store.stats()["spills"] > 0


def test_a_disk_freed_mid_backoff_takes_spills_at_the_next_pass(cache_name, small_disk, caplog):
    """Another file filled the disk tier's file system, then went: the next
    pass spills and renews the spill guard at once, not when a backoff of up
    to 30 s ends (meanwhile puts would evict chunks the disk could take)."""
    store = Store.create(cache_name, 8 << 20, populate=False)
    disk = DiskTier(os.path.join(small_disk, cache_name), capacity_bytes=1 << 30, counter=store.bump)
    disk.rebuild_index()
    filler = os.path.join(small_disk, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as e:  # full
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    for i in range(4):
        store.put(key(i), os.urandom(CHUNK), namespace=b"N" * 16)
    m = Maintainer(TierChain(store, [disk]), spill_ahead=0.99, low_watermark=0.0)
    caplog.set_level(logging.INFO, logger="shmkv")
    deadline = time.monotonic() + 30
    while m.backoff.delay_s < 1.0 and time.monotonic() < deadline:  # failing spills, the backoff doubling
        m.run_once()
    assert m.backoff.delay_s >= 1.0 and not m.backoff.ready(), "the backoff holds spills off"
    assert store.stats()["spills"] == 0
    store.renew_spill_guard(0)  # lapsed, as it does 2 s into the backoff
    m.run_once()
    assert not store.spill_guard_active(), "no guard while spills fail: puts may still evict"
    os.unlink(filler)
    m.run_once()
    assert store.stats()["spills"] == 4, "the next pass spilled every chunk"
    assert store.spill_guard_active(), "and the guard is back"
    assert any("has room again" in r.getMessage() for r in caplog.records)
    assert any("works again" in r.getMessage() for r in caplog.records)
