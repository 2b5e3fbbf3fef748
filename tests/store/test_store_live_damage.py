"""Damaged metadata in a live segment (a buggy or hostile process of the same
user) never becomes a wild pointer: impossible derived values are found
before use, the table is rebuilt (or reset), and the process goes on. A
segment file truncated under live processes is found and restored by the
maintainer's size check; attaching one says what happened.

What is not promised: a process of the same user can overwrite payload bytes
as it likes, so these tests check that nothing crashes or hangs, not which
chunks survive the damage."""

from __future__ import annotations

import mmap
import os
import struct
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, key, payload_for

from shmkv import _C, PutResult, Store
from shmkv.errors import SegmentCorruptError
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import TierChain

OFF = _C.LAYOUT_OFFSETS


def poke(name: str, offset: int, data: bytes) -> None:
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        with mmap.mmap(fd, offset + len(data) + 4096 - (offset + len(data)) % 4096) as m:
            m[offset:offset + len(data)] = data
    finally:
        os.close(fd)


def filled(name: str, n: int = 20) -> Store:
    s = Store.create(name, 8 << 20, populate=False)
    for i in range(n):
        assert s.put(key(i), payload_for(key(i), 8192)) is PutResult.OK
    return s


@pytest.mark.parametrize("field,value", [
    ("free_entry_head", struct.pack("<I", 0xF0000000)),
    ("lru_tail", struct.pack("<I", 0x7FFFFFF0)),
    ("lru_head", struct.pack("<I", 3)),
    ("free_lease_head", struct.pack("<I", 0xDEADBEEF)),
    ("num_extents", struct.pack("<Q", 1 << 40)),
    ("evictable_bytes", struct.pack("<Q", 1 << 62)),
])
def test_a_damaged_root_is_repaired_not_followed(cache_name, field, value):
    s = filled(cache_name)
    poke(cache_name, OFF[field], value)
    # every kind of operation, each of which reads some derived structure
    assert s.put(key(100), payload_for(key(100), 8192)) in (PutResult.OK, PutResult.EXISTS)
    for i in range(30, 60):  # enough to evict: walks the LRU and the allocator
        s.put(key(i), payload_for(key(i), 65536))
    with s.acquire(key(100)) as lease:
        assert lease is None or bytes(lease.view()) == payload_for(key(100), 8192)
    s.delete(key(31))
    s.clear()
    assert s.stats()["metadata_repairs"] >= 1
    assert s.check_consistency() == []


RANDOM_DAMAGE = """
import mmap, os, random, sys
from shmkv import Store, _C
from shmkv.errors import ShmkvError
sys.path.insert(0, {tests!r})
from helpers import key, payload_for
name, seed, trials = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
outcomes = {{"ok": 0, "error": 0}}
for t in range(trials):
    s = Store.create(name, 4 << 20, populate=False, lock_timeout_s=0.05)
    for i in range(12):
        s.put(key(i), payload_for(key(i), 16384))
    meta = s.stats()["capacity_bytes"] - s.arena_bytes
    fd = os.open("/dev/shm/" + name, os.O_RDWR)
    with mmap.mmap(fd, meta) as m:
        for _ in range(rng.randint(1, 64)):
            m[rng.randrange(meta)] = rng.randrange(256)
    os.close(fd)
    try:
        for i in range(40):
            s.put(key(1000 + i), payload_for(key(1000 + i), 65536))
            s.lookup_prefix([key(i % 12), key(1000 + i)])
            lease = s.acquire(key(i % 12))
            if lease is not None:
                bytes(lease.view()[:16])
                lease.release()
        s.pin(key(3)); s.unpin(key(3)); s.delete(key(5)); s.coldest(100); s.reclaim(); s.clear()
        s.check_consistency()
        outcomes["ok"] += 1
    except ShmkvError:
        outcomes["error"] += 1  # a clean error (e.g. a garbage mutex) is allowed; a signal is not
    s.close()
    Store.unlink(name)
print(outcomes, flush=True)
"""


def test_random_metadata_damage_never_kills_the_process(cache_name):
    code = textwrap.dedent(RANDOM_DAMAGE.format(tests=os.path.join(REPO, "tests", "support")))
    for seed in range(3):
        r = subprocess.run([sys.executable, "-c", code, f"{cache_name}-{seed}", str(seed), "100"],
                           capture_output=True, text=True, timeout=600, cwd=REPO)
        Store.unlink(f"{cache_name}-{seed}")
        assert r.returncode == 0, f"seed {seed}: exit {r.returncode} (negative: killed by a signal)\n{r.stderr[-3000:]}"
        assert "'ok'" in r.stdout, r.stdout


def test_a_truncated_segment_is_restored_by_the_size_check(cache_name):
    s = filled(cache_name)
    os.truncate(f"/dev/shm/{cache_name}", 4096)
    with pytest.raises(SegmentCorruptError, match="truncated"):
        Store.attach(cache_name, populate=False)
    did = Maintainer(TierChain(s)).run_once()  # checks the size before touching anything past the header
    assert did.get("restored") == 1
    assert os.stat(f"/dev/shm/{cache_name}").st_size == s.stats()["capacity_bytes"]
    st = s.stats()
    assert st["segment_truncated"] == 1 and st["segment_resets"] == 1 and st["entries"] == 0
    assert s.put(key(1), payload_for(key(1), 8192)) is PutResult.OK
    other = Store.attach(cache_name, populate=False)
    assert other.get(key(1)) == payload_for(key(1), 8192)
    assert s.check_size() is True


def test_a_damaged_header_names_what_is_wrong(cache_name):
    s = filled(cache_name)
    s.close()
    del s
    poke(cache_name, OFF["geo_max_entries"], struct.pack("<I", 7))
    with pytest.raises(SegmentCorruptError, match="does not match its layout fingerprint") as e:
        Store.attach(cache_name, populate=False)
    assert "file size" not in str(e.value), "not the old message with two equal sizes"
