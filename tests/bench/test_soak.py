"""The chaos soak (bounded for CI) and its audit: kill -9 of random workers
every few hundred milliseconds leaves no corrupt byte, no leaked lease or
write, and a consistent table; the audit itself catches each kind of damage."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from shmkv import PutResult, Store
from shmkv.bench.soak_bench import audit, key_of, payload_of

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("namespaces", [
    pytest.param([], id="one-pid-namespace"),
    # as containers run: each of 3 workers and the daemon (its maintainer reclaims every 50 ms) in a PID
    # namespace of its own, the audit in the host's
    pytest.param(["--workers", "3", "--pid-namespaces", "--daemon"], id="a-pid-namespace-each",
                 marks=pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces need root (unshare), as in CI")),
])
def test_bounded_soak(namespaces):
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "soak", "--seconds", "20", "--json", *namespaces],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["kills"] >= 20 and res["ops"] > 10_000, res
    assert res["corrupt_reads"] == 0 and res["corrupt_entries"] == 0, res
    assert res["leaked_leases"] == 0 and res["leaked_writes"] == 0, res
    assert res["live_holders_reclaimed"] == 0, res
    assert res["consistency_ok"] and res["bytes_ok"] and res["ok"], res
    assert res["daemon_maintained"] is (True if "--daemon" in namespaces else None), res


def test_audit_catches_what_it_looks_for(cache_name, child):
    s = Store.create(cache_name, 8 << 20, populate=False)
    for i in range(5):
        assert s.put(key_of(i), payload_of(key_of(i))) is PutResult.OK
    assert audit(s)["corrupt_entries"] == 0
    wrong = bytearray(payload_of(key_of(7)))
    wrong[100] ^= 1
    assert s.put(key_of(7), bytes(wrong)) is PutResult.OK
    holder = child(f"""
        from shmkv import Store
        from shmkv.bench.soak_bench import key_of
        s = Store.attach({cache_name!r}, populate=False)
        lease = s.acquire(key_of(1))
        r = s.reserve(key_of(9), 1000)
        print("holding", flush=True)
        input()
    """)
    holder.expect("holding")
    res = audit(s)  # the holder is alive: its lease and write are not reclaimed, so they show
    assert res["corrupt_entries"] == 1 and res["leaked_leases"] == 1 and res["leaked_writes"] == 1
    assert res["consistency_ok"] and res["bytes_ok"]
    holder.kill9()
    res = audit(s)  # dead now: reclaimed
    assert res["leaked_leases"] == 0 and res["leaked_writes"] == 0
    assert res["reclaimed_at_end"]["leases"] == 1 and res["reclaimed_at_end"]["writes"] == 1
    s.close()
