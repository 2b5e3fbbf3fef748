"""Two records under one key (written into the segment by a buggy or hostile
process of our uid): adopting the stale segment keeps neither (no writer
makes two committed records of a key, so neither can be trusted: a miss,
never a forged record served), and says so; a live segment's consistency
check names the duplicate."""

from __future__ import annotations

import mmap

from shmkv import Store
from shmkv.store import OpenOutcome

A, B, C = bytes(range(16)), bytes(range(100, 116)), bytes(range(200, 216))


def rename_record(cache_name: str, old: bytes, new: bytes) -> None:
    """Overwrite the one place the segment holds key `old` (its entry record) with `new`."""
    with open(f"/dev/shm/{cache_name}", "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        assert m[:].count(old) == 1
        i = m.find(old)
        m[i:i + 16] = new


def test_adoption_keeps_no_record_of_a_key_held_twice(cache_name, caplog):
    s = Store.create(cache_name, 8 << 20, populate=False)
    s.put(A, b"\x01" * 4096)
    s.put(B, b"\x02" * 4096)
    s.put(C, b"\x03" * 4096)
    s.close()
    rename_record(cache_name, B, A)
    with caplog.at_level("WARNING"):
        s = Store.attach(cache_name, populate=False)
    try:
        assert s.outcome is OpenOutcome.ADOPTED_STALE
        st = s.stats()
        assert st["entries"] == 1 and st["ready_entries"] == 1, "only the key held once"
        assert s.get(A) is None and s.get(B) is None and s.get(C) == b"\x03" * 4096
        assert s.check_consistency() == []
        assert any("held twice" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        s.close()


def test_a_live_segments_check_names_the_duplicate(cache_name):
    s = Store.create(cache_name, 8 << 20, populate=False)
    try:
        s.put(A, b"\x01" * 4096)
        s.put(B, b"\x02" * 4096)
        rename_record(cache_name, B, A)
        bad = s.check_consistency()
        assert bad and any("not reachable through the index" in b for b in bad), bad
    finally:
        s.close()
