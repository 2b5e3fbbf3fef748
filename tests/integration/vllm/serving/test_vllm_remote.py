"""Two "hosts" (two caches with different names and disk directories) share
one redis-server: a prompt computed on the first hits on the second with
identical output; garbage under shmkv's keys is rejected; killing the server
mid-run leaves the engine serving from its local tiers, counting misses."""

from __future__ import annotations

import time

import pytest
from helpers import random_prompt

from shmkv import Store
from shmkv.chunking import Chunker
from shmkv.config import io_threads, load_config
from shmkv.namespaces import known
from shmkv.tiers.remote.signing import chunk_key

pytestmark = pytest.mark.slow


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_two_hosts_share_through_redis(cache_name, second_cache, start_engine, reference, redis_server, tmp_path):
    host_a = {"cache_name": cache_name, "capacity": "64MiB", "disk_dir": str(tmp_path / "disk-a"),
              "remote_url": redis_server.url, "spill_ahead": 0.9}
    # NOTE: a generous bound on host B's remote calls: this test is about what the checks reject, and a
    # GET that outran a tighter bound on a loaded 2-core machine was a miss, so no check ran (the bound's
    # own behaviour: tests/tiers/test_remote_odd_servers.py). A killed server still fails at once (refused)
    host_b = {"cache_name": second_cache, "capacity": "64MiB", "disk_dir": str(tmp_path / "disk-b"),
              "remote_url": redis_server.url, "remote_timeout": 10.0}
    p, g, q = (random_prompt(700, seed=s) for s in (91, 92, 93))

    a = start_engine("host-a", shmkv=host_a)
    assert a.generate([p])["num_cached_tokens"] == [0]
    with Store.attach(cache_name) as sa:  # spilled by host A's maintainer, then written to Redis
        wait_for(lambda: sa.stats()["remote_puts"] >= 3, what="host A's chunks to reach Redis")
    a.close()

    b = start_engine("host-b", shmkv=host_b)
    sb = Store.attach(second_cache)
    r = b.generate([p])
    assert r["num_cached_tokens"] == [640], "2 chunks and the 128-token piece, fetched from Redis"
    assert r["outputs"][0] == reference.output(p, 640)
    assert sb.stats()["remote_hits"] == 3

    # garbage under the keys of prompt g: rejected by the checks, computed instead
    (root,) = known(second_cache)
    client = redis_server.client()
    for u in Chunker([bytes.fromhex(root)], 256, 128).units(g):
        client.set(chunk_key(u.keys[0], bytes.fromhex(root)), b"\x00garbage" * 100)
    r = b.generate([g])
    assert r["num_cached_tokens"] == [0] and r["outputs"][0] == reference.output(g, 0)
    st = sb.stats()
    assert st["remote_hits"] == 3, "nothing of prompt g was promoted: the first bad value ends the prefix"
    # promotion fetches up to io_threads chunks ahead: one fetched beside the first may be found bad too
    assert 1 <= st["remote_damaged"] <= io_threads(load_config(host_b, env={}))

    # the server dies mid-run: serving goes on from the local tiers, misses are counted
    misses = sb.stats()["remote_misses"]
    redis_server.kill()
    r = b.generate([q])
    assert r["num_cached_tokens"] == [0] and r["outputs"][0] == reference.output(q, 0)
    st = sb.stats()
    assert st["remote_misses"] > misses and st["remote_errors"] >= 1
    r = b.generate([p])
    assert r["num_cached_tokens"] == [640] and r["outputs"][0] == reference.output(p, 640)
    sb.close()
