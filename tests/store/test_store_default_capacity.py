"""With no explicit capacity, every process agrees on the segment: an existing
one (live or stale) is used as it is, whatever its size, and the default for
a new one depends on /dev/shm's size, not on what the segment itself took.
An explicit capacity re-creates a stale segment of another geometry (the log
says how many chunks that dropped) and attaches a live one as it is."""

from __future__ import annotations

import logging
import os

from helpers import key, payload_for

from shmkv import Store
from shmkv.config import default_capacity, load_config
from shmkv.store import OpenOutcome, open_store


def cfg(name: str, **extra):
    return load_config({"cache_name": name, "populate": False, **extra}, env={})


def test_default_does_not_depend_on_free_space(cache_name):
    before = default_capacity()
    st = os.statvfs("/dev/shm")
    assert before == max(256 << 20, min(16 << 30, st.f_blocks * st.f_frsize // 4 // (1 << 20) * (1 << 20)))
    big = Store.create(cache_name, 256 << 20, populate=True)  # takes real /dev/shm space
    try:
        assert default_capacity() == before
    finally:
        big.close()


def test_no_capacity_adopts_a_stale_segment_of_any_size_with_its_chunks(cache_name):
    first = Store.create(cache_name, 24 << 20, populate=False)
    first.put(key(1), payload_for(key(1), 8192))
    first.close()
    del first  # every process gone: the segment is stale
    s = open_store(cfg(cache_name))
    assert s.outcome is OpenOutcome.ADOPTED_STALE
    assert s.stats()["capacity_bytes"] == 24 << 20 != default_capacity()
    assert s.get(key(1)) == payload_for(key(1), 8192)


def test_no_capacity_attaches_a_live_segment_as_it_is(cache_name):
    live = Store.create(cache_name, 24 << 20, populate=False)
    live.put(key(2), payload_for(key(2), 8192))
    s = open_store(cfg(cache_name))
    assert s.outcome is OpenOutcome.ATTACHED and s.get(key(2)) == payload_for(key(2), 8192)


def test_no_capacity_and_no_segment_creates_the_default(cache_name, caplog):
    caplog.set_level(logging.INFO, logger="shmkv")
    s = open_store(cfg(cache_name))
    assert s.outcome is OpenOutcome.CREATED and s.stats()["capacity_bytes"] == default_capacity()
    assert any("default capacity" in r.getMessage() for r in caplog.records)


def test_explicit_capacity_recreates_a_stale_segment_and_says_what_it_dropped(cache_name, caplog):
    first = Store.create(cache_name, 24 << 20, populate=False)
    for i in range(3):
        first.put(key(i), payload_for(key(i), 8192))
    first.close()
    del first
    caplog.set_level(logging.INFO, logger="shmkv")
    s = open_store(cfg(cache_name, capacity="32MiB"))
    assert s.outcome is OpenOutcome.REINITIALISED_STALE and s.stats()["capacity_bytes"] == 32 << 20
    assert any("3 chunks dropped" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_explicit_capacity_attaches_a_live_segment_of_another_size(cache_name, caplog):
    live = Store.create(cache_name, 24 << 20, populate=False)
    live.put(key(4), payload_for(key(4), 8192))
    s = open_store(cfg(cache_name, capacity="32MiB"))
    assert s.outcome is OpenOutcome.ATTACHED and s.stats()["capacity_bytes"] == 24 << 20
    assert s.get(key(4)) == payload_for(key(4), 8192)
