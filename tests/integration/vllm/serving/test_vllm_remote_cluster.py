"""Two "hosts" (two segments) share chunks through a Redis Cluster of 3
primaries and 3 replicas; a primary is killed (-9) between them: while it is
down the second host's engine hits what the live shards hold, counts the
misses, gets no error and gives the output of the same split; once its
replica has taken over, a third host hits the whole prompt again and its own
writes reach the cluster."""

from __future__ import annotations

import time

import pytest
import redis
from helpers import random_prompt
from redis.cluster import RedisCluster

from shmkv import Store
from shmkv.engines.redis_server import PrivateRedisCluster
from shmkv.namespaces import known
from shmkv.tiers.remote.signing import chunk_key

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=31)
Q = random_prompt(600, seed=32)


def wait_for(pred, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling another process's progress, bounded


@pytest.fixture
def cluster(tmp_path):
    # a node timeout longer than the test: the replica takes over only when the test says so
    c = PrivateRedisCluster(str(tmp_path / "cluster"), masters=3, replicas=1, node_timeout_ms=600_000)
    yield c
    c.kill()


def host(cache, cluster):
    """A host's settings: the cluster named by all its nodes (README: a node named alone could be the one down)."""
    seeds = ",".join(f"redis://127.0.0.1:{p}" for p in cluster.ports)
    return {"cache_name": cache, "capacity": "64MiB", "remote_url": seeds, "remote_write_through": True,
            "remote_timeout": 0.5}


def test_hosts_share_through_a_cluster_across_a_failover(cache_name, second_cache, start_engine, reference,
                                                          cluster):
    a = start_engine("cluster-a", shmkv=host(cache_name, cluster))
    assert a.generate([P])["num_cached_tokens"] == [0]
    with Store.attach(cache_name) as sa:
        wait_for(lambda: sa.stats()["remote_puts"] >= 12, what="host A's chunks to reach the cluster")
    a.close()
    (root,) = known(cache_name)
    view = RedisCluster(host="127.0.0.1", port=cluster.ports[0])
    keys = [k for k in view.scan_iter(match=b"shmkv:v1:c:*")]
    assert len(keys) == 12
    # the primary holding the 6th chunk dies (its writes replicated first)
    from shmkv.chunking import Chunker

    units = Chunker([bytes.fromhex(root)], 256, 128).units(P)
    sixth = chunk_key(units[5].keys[0], bytes.fromhex(root))
    victim = view.get_node_from_key(sixth).port
    before = [view.get_node_from_key(chunk_key(u.keys[0], bytes.fromhex(root))).port for u in units]
    view.close()
    assert redis.Redis(port=victim, socket_timeout=5).wait(1, 5000) == 1
    cluster.kill_node(victim)  # no failover yet: its node timeout is longer than the test

    b = start_engine("cluster-b", shmkv=host(second_cache, cluster))
    r = b.generate([P])
    first_lost = before.index(victim)
    assert r["num_cached_tokens"] == [first_lost * 256], "the prefix the live shards hold"
    assert r["outputs"][0] == reference.output(P, first_lost * 256)
    with Store.attach(second_cache) as sb:
        assert sb.stats()["remote_errors"] + sb.stats()["remote_misses"] >= 1
    b.close()

    cluster.promote_replica_of(victim)
    third = second_cache + "-c"
    c = start_engine("cluster-c", shmkv=host(third, cluster))
    try:
        hit = 0
        for _ in range(10):  # the first lookups may still meet the old slot map (counted misses, a backoff)
            r = c.generate([P])
            hit = r["num_cached_tokens"][0]
            if hit == 2944:
                break
            with Store.attach(third) as sc:  # the operator's clear: the next try looks in the remote again
                sc.clear()
        assert hit == 2944 and r["outputs"][0] == reference.output(P, 2944), "the promoted replica serves"
        with Store.attach(third) as sc:
            puts = sc.stats()["remote_puts"]
            assert c.generate([Q])["num_cached_tokens"] == [0]
            wait_for(lambda: sc.stats()["remote_puts"] > puts, what="a write after the failover")
    finally:
        c.close()
        Store.unlink(third)
