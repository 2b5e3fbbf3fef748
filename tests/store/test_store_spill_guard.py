"""Nothing committed is lost to eviction while a disk tier can take it:
while the maintainer's spills reach the disk it renews the spill guard, and
a put then evicts only chunks already on disk; none within reach of the LRU
tail means the writes outran the disk, and the newest put answers FULL
(put_spill_behind) instead of evicting a chunk the disk never got. A guard
that lapses (a failing disk backs off, the maintainer stops) lets puts evict
from the tail again (evicted_unspilled)."""

from __future__ import annotations

import logging

import pytest
from helpers import key, payload_for

from shmkv import PutResult, Store
from shmkv.config import load_config
from shmkv.services.maintainer import Maintainer
from shmkv.store import FLAG_SPILLED
from shmkv.tiers import open_tiers

UNIT = 64 * 1024


@pytest.fixture
def full_store(cache_name):
    s = Store.create(cache_name, 2 << 20, alignment=UNIT, max_payload_bytes=UNIT, max_entries=256)
    n = 0
    while s.put(key(n), payload_for(key(n), UNIT)) is PutResult.OK and s.stats()["evictions"] == 0:
        n += 1
    assert s.stats()["evictions"] == 1, "filled to the first eviction"
    yield s, n
    s.close()


def test_under_the_guard_a_put_evicts_only_what_is_on_disk(full_store):
    s, n = full_store
    s.renew_spill_guard(60)
    assert s.spill_guard_active()
    before = s.stats()
    assert s.put(key("new"), b"x" * UNIT) is PutResult.FULL, "nothing on disk: the newest put gives"
    st = s.stats()
    assert st["put_spill_behind"] == before["put_spill_behind"] + 1 and st["evictions"] == before["evictions"]
    assert st["put_full"] == before["put_full"], "counted as behind the disk, not as full"
    spilled = key(n // 2)  # on disk now, in the middle of the LRU order
    assert s.mark_spilled(spilled)
    assert s.put(key("new"), b"x" * UNIT) is PutResult.OK
    assert s.contains([spilled, key(1)]) == [False, True], "the spilled chunk went, not the LRU tail"
    assert s.stats()["evicted_unspilled"] == before["evicted_unspilled"]


def test_a_lapsed_guard_lets_puts_evict_from_the_tail(full_store):
    s, _ = full_store
    s.renew_spill_guard(60)
    s.renew_spill_guard(0)  # lifted (a maintainer that stops)
    assert not s.spill_guard_active()
    before = s.stats()["evicted_unspilled"]
    assert s.put(key("new"), b"x" * UNIT) is PutResult.OK
    assert s.stats()["evicted_unspilled"] == before + 1


def test_the_guard_is_refused_a_bad_duration(full_store):
    s, _ = full_store
    for bad in (-1.0, 1e9, float("nan")):
        with pytest.raises(ValueError, match="spill guard seconds"):
            s.renew_spill_guard(bad)


def test_the_maintainer_renews_the_guard_only_while_its_spills_work(cache_name, tmp_path, caplog):
    s = Store.create(cache_name, 2 << 20, alignment=UNIT, max_payload_bytes=UNIT, max_entries=256)
    cfg = load_config({"cache_name": cache_name, "disk_dir": str(tmp_path / "disk"), "io_threads": 1}, env={})
    chain = open_tiers(cfg, s)
    m = Maintainer(chain)
    try:
        m.run_once()
        assert s.spill_guard_active(), "a working disk: renewed"
        s.renew_spill_guard(0)
        m.backoff.failed()  # the disk fails: spills back off
        m.run_once()
        assert not s.spill_guard_active(), "a failing disk: the guard lapses"
        m.backoff.worked()
        # writes outrun the disk: one WARNING names the rates
        caplog.set_level(logging.WARNING, logger="shmkv.maintainer")
        m.run_once()
        n = 0
        while s.put(key(n), payload_for(key(n), UNIT)) is PutResult.OK:
            n += 1
        s.put(key(n + 1), b"y" * UNIT)
        m.run_once()
        m.run_once()
        warned = [r for r in caplog.records if "writes outrun the disk tier" in r.getMessage()]
        assert len(warned) == 1 and "MB/s committed" in warned[0].getMessage()
        # the maintainer spills what puts were refused for; then puts go on
        for _ in range(20):
            m.run_once()
            if all(e["flags"] & FLAG_SPILLED for e in s.entries()):
                break
        assert s.put(key("after"), b"z" * UNIT) is PutResult.OK
    finally:
        m.close()
        chain.close()
        s.close()
