"""Spill and promotion with several threads, killed with SIGKILL midway:
no torn chunk file is ever read, no chunk is marked spilled without its
file, the shared tier stays consistent with only a prefix promoted, and the
counters lag the files by at most the writes that were in flight."""

from __future__ import annotations

import os
import time

import pytest
import torch

from shmkv import PutResult, Store
from shmkv.store import FLAG_SPILLED
from shmkv.tiers.disk.tier import DiskTier

N, CHUNK, THREADS = 128, 2 << 20, 2
NS = b"N" * 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> bytes:
    g = torch.Generator().manual_seed(i)
    return torch.randn(CHUNK // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.fixture
def filled(cache_name, tmp_path):
    store = Store.create(cache_name, N * CHUNK + (64 << 20), max_payload_bytes=CHUNK)
    expected = {key(i): payload(i) for i in range(N)}
    for k, p in expected.items():
        assert store.put(k, p, namespace=NS, tokens=256) is PutResult.OK
    yield store, expected, str(tmp_path / "disk")
    store.close()


def wait_until(cond, proc, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, "the child ended before it could be killed midway"
        assert time.monotonic() < deadline, "the child made no progress"


SPILL = """
    from shmkv import Store
    from shmkv.tiers.disk.tier import DiskTier
    from shmkv.services.maintainer import Maintainer
    from shmkv.tiers import TierChain
    store = Store.attach({name!r})
    disk = DiskTier({dir!r}, capacity_bytes=1 << 40, codec="zstd", counter=store.bump)
    m = Maintainer(TierChain(store, [disk]), threads={threads})
    print("go", flush=True)
    m.spill_all()
    print("done", flush=True)
"""

PROMOTE = """
    from shmkv import Store
    from shmkv.tiers.disk.tier import DiskTier
    from shmkv.tiers import TierChain
    store = Store.attach({name!r})
    disk = DiskTier({dir!r}, capacity_bytes=1 << 40, counter=store.bump)
    chain = TierChain(store, [disk], threads={threads})
    print("go", flush=True)
    chain.promote([i.to_bytes(16, "little") for i in range({n})], [b"N" * 16] * {n})
    print("done", flush=True)
"""


def kv_files(d: str) -> list[str]:
    return [n for n in os.listdir(d) if n.endswith(".kv")] if os.path.isdir(d) else []


def test_spill_killed_midway(filled, child):
    store, expected, d = filled
    c = child(SPILL.format(name=store.name, dir=d, threads=THREADS))
    c.expect("go")
    wait_until(lambda: len(kv_files(d)) >= 8, c.proc)
    c.kill9()

    disk = DiskTier(d, capacity_bytes=1 << 40)
    files, _ = disk.rebuild_index()
    assert 8 <= files < N, "killed midway"
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")], "the killed writer's temporary files are removed"
    on_disk = {bytes.fromhex(n[:32]) for n in kv_files(d)}
    for k in on_disk:
        assert disk.read(k) == expected[k], "a complete file, never a torn one"
    flagged = {e["key"] for e in store.entries() if e["flags"] & FLAG_SPILLED}
    assert flagged <= on_disk, "no chunk is marked spilled without its file"
    st = store.stats()
    assert files - THREADS <= st["spills"] <= files and st["spill_errors"] == 0
    assert st["spill_tokens"] == 256 * st["spills"]

    # a new maintainer finishes the job
    from shmkv.services.maintainer import Maintainer
    from shmkv.tiers import TierChain

    spilled, left = Maintainer(TierChain(store, [DiskTier(d, capacity_bytes=1 << 40, counter=store.bump)]),
                               threads=THREADS).spill_all()
    assert left == 0 and len(kv_files(d)) == N
    assert all(DiskTier(d, capacity_bytes=1 << 40).read(k) == p for k, p in expected.items())


def test_promotion_killed_midway(filled, child):
    store, expected, d = filled
    from shmkv.services.maintainer import Maintainer
    from shmkv.tiers import TierChain

    disk = DiskTier(d, capacity_bytes=1 << 40, counter=store.bump)
    assert Maintainer(TierChain(store, [disk]), threads=THREADS).spill_all() == (N, 0)
    store.clear()
    c = child(PROMOTE.format(name=store.name, dir=d, threads=THREADS, n=N))
    c.expect("go")
    wait_until(lambda: store.stats()["disk_hits"] >= 8, c.proc)
    c.kill9()

    store.reclaim()  # what the dead promoter held: leases, half-written chunks
    assert store.check_consistency() == []
    st = store.stats()
    assert st["leases_held"] == 0
    ready = [e["key"] for e in store.entries() if e["state"] == "ready"]
    assert not [e for e in store.entries() if e["state"] == "writing"], "no half-written chunk is left"
    assert 8 <= len(ready) < N, "killed midway"
    assert set(ready) == {key(i) for i in range(len(ready))}, "promotion puts a prefix, in order"
    assert all(store.get(k) == expected[k] for k in ready)
    assert len(ready) - 1 <= st["disk_hits"] <= len(ready)
