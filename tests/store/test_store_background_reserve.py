"""A new segment is usable at once: it reserves its metadata and the first
256 MiB of its arena, the rest in the background. The allocator never hands
out bytes beyond the reserved part (no write can land on a page /dev/shm
might refuse): meanwhile the cache works as a smaller one, and a FULL answer
for want of reserved pages is counted in put_unreserved; a process that dies
midway leaves the rest to the next one that opens the segment."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmkv import PutResult, Store

MiB = 1 << 20
FIRST = 256 * MiB
CHUNK = 64 * MiB


def fill(store: Store, n: int, tag: int = 0) -> list[PutResult]:
    payload = np.full(CHUNK, 7, dtype=np.uint8)
    return [store.put(bytes([tag, i]) * 8, payload) for i in range(n)]


def test_only_the_reserved_part_is_handed_out(cache_name):
    with Store.create(cache_name, 768 * MiB, background_reserve=False, max_payload_bytes=CHUNK) as store:
        st = store.stats()
        assert st["arena_reserved_bytes"] == FIRST < st["arena_bytes"]
        assert fill(store, 4) == [PutResult.OK] * 4
        assert fill(store, 1, tag=1) == [PutResult.OK], "the cache works as a smaller one meanwhile"
        assert store.stats()["evictions"] == 1, "room was made inside the reserved part"
        assert store.check_consistency() == [], "no entry lies beyond the reserved part"
        for i in range(1, 4):
            assert store.pin(bytes([0, i]) * 8)
        assert store.pin(bytes([1, 0]) * 8)
        assert fill(store, 1, tag=2) == [PutResult.FULL]
        st = store.stats()
        assert (st["put_unreserved"], st["put_full"]) == (1, 0), "counted as FULL for want of reserved pages"

        assert store.reserve_more(CHUNK) == FIRST + CHUNK
        assert fill(store, 1, tag=2) == [PutResult.OK]
        assert store.stats()["evictions"] == 1, "the new part held it: nothing evicted"
        assert store.reserve_more(1 << 40) == store.stats()["arena_bytes"]
        assert store.reserve_more(CHUNK) == store.stats()["arena_bytes"], "nothing left: a no-op"
        fill(store, 16, tag=3)  # now everything is reserved: the whole arena is used
        st = store.stats()
        assert st["put_unreserved"] == 1 and st["bytes_used"] > FIRST + CHUNK
        assert store.check_consistency() == []


def test_the_background_reserves_the_rest(cache_name):
    with Store.create(cache_name, 768 * MiB, max_payload_bytes=CHUNK) as store:
        assert store.wait_reserved(timeout_s=120), "the whole arena is reserved in the end"
        assert fill(store, 11) == [PutResult.OK] * 11
        assert store.stats()["put_unreserved"] == 0
        assert store.check_consistency() == []


def test_a_creator_gone_midway_leaves_the_rest_to_the_next(cache_name):
    code = textwrap.dedent(f"""
        from shmkv import Store
        s = Store.create({cache_name!r}, 768 << 20, background_reserve=False)
        s.reserve_more(64 << 20)
        import os
        os._exit(0)  # gone without closing, as a killed process would be
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with Store.attach(cache_name) as store:
        assert store.outcome.name == "ADOPTED_STALE"
        assert store.wait_reserved(timeout_s=120)
        assert store.check_consistency() == []


def test_an_attacher_without_background_leaves_it_as_it_is(cache_name):
    with Store.create(cache_name, 768 * MiB, background_reserve=False) as first:
        with Store.attach(cache_name, background_reserve=False) as second:
            assert second.stats()["arena_reserved_bytes"] == FIRST
            second.reserve_more(CHUNK)
        assert first.stats()["arena_reserved_bytes"] == FIRST + CHUNK, "shared: one reserved part for all"


@pytest.mark.parametrize("capacity", [64 * MiB, 200 * MiB])
def test_small_segments_are_reserved_whole_at_creation(cache_name, capacity):
    with Store.create(cache_name, capacity) as store:
        st = store.stats()
        assert st["arena_reserved_bytes"] == st["arena_bytes"]
        assert store.wait_reserved(timeout_s=0)


def test_a_process_ending_while_its_pages_are_mapped_exits_cleanly(cache_name):
    """The background thread maps the pages after reserving them; a process
    that ends meanwhile (here: by an uncaught exception, the store never
    closed) exits with its own status, not std::terminate's SIGABRT."""
    code = textwrap.dedent(f"""
        from shmkv import Store
        s = Store.create({cache_name!r}, 4 << 30, max_payload_bytes=1 << 20)
        assert s.wait_reserved(timeout_s=120)
        assert s._reserver is not None and s._reserver.is_alive(), "the mapping still runs"
        raise SystemExit("ended while mapping")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "ended while mapping" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "terminate called" not in r.stderr
