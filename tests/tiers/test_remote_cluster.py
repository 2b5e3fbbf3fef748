"""The remote tier on a Redis Cluster (3 primaries on loopback): the URL of
any one node is enough (cluster mode is detected), or a comma-separated list
of seeds; chunks spread over every shard and read back checked; lookups,
promotion and clear work across slots; the byte budget, a multi-key script,
is refused with the servers' own eviction named instead."""

from __future__ import annotations

import time

import pytest
from helpers import key, payload_for

from shmkv import PutResult
from shmkv.config import load_config
from shmkv.errors import ConfigError
from shmkv.tiers import open_tiers

NS = b"N" * 16
SIZE = 8 * 1024
N = 60


@pytest.fixture
def store(small_store):
    return small_store


def chain(store, url, **kw):
    return open_tiers(load_config({"cache_name": store.name, "remote_url": url, "remote_timeout": 5, **kw},
                                  env={}), store)


@pytest.mark.parametrize("seeds", [False, True])
def test_chunks_spread_over_every_shard_and_read_back(store, redis_cluster, seeds):
    url = (",".join(f"redis://127.0.0.1:{p}" for p in redis_cluster.ports) if seeds
           else f"redis://127.0.0.1:{redis_cluster.ports[-1]}/0")  # any one node
    c = chain(store, url)
    assert c.remote.cluster
    for i in range(N):
        assert c.remote.write(key(i), NS, payload_for(key(i), SIZE))
    per_node = redis_cluster.keys_per_node()
    assert sum(per_node.values()) == N and all(n > 0 for n in per_node.values()), per_node
    assert c.remote.contains([key(i) for i in range(N + 1)], [NS] * (N + 1)) == [True] * N + [False]
    assert all(c.remote.fetch(key(i), NS) == (payload_for(key(i), SIZE), NS) for i in range(0, N, 7))
    assert c.promote([key(i) for i in range(5)], [NS] * 5) == 5
    assert store.get(key(3)) == payload_for(key(3), SIZE)
    assert c.remote.remove(key(0), NS) and not c.remote.contains([key(0)], [NS])[0]
    assert c.remote.clear(NS) == N - 1 and sum(redis_cluster.keys_per_node().values()) == 0
    assert store.stats()["remote_errors"] == 0
    c.close()


def test_write_through_from_the_shared_tier(store, redis_cluster):
    c = chain(store, redis_cluster.url)
    for i in range(10):
        assert store.put(key(i), payload_for(key(i), SIZE), namespace=NS) is PutResult.OK
        assert c.remote.enqueue(key(i), NS)
    assert c.remote.flush(timeout_s=30)
    assert sum(redis_cluster.keys_per_node().values()) == 10 and store.stats()["remote_puts"] == 10
    c.close()


def test_a_byte_budget_on_a_cluster_is_refused(store, redis_cluster):
    with pytest.raises(ConfigError, match="maxmemory-policy allkeys-lru"):
        chain(store, redis_cluster.url, remote_capacity="1GiB")


@pytest.fixture
def replicated_cluster(tmp_path):
    from shmkv.engines.redis_server import PrivateRedisCluster

    cluster = PrivateRedisCluster(str(tmp_path), masters=3, replicas=1)
    yield cluster
    cluster.kill()


def test_a_primary_lost_is_misses_then_its_replica_serves(store, replicated_cluster):
    """While a primary is down its chunks are counted misses, never an error;
    once its replica is promoted, reads and writes work again."""
    import redis

    cl = replicated_cluster
    c = chain(store, cl.url, remote_timeout=0.5)
    for i in range(N):
        assert c.remote.write(key(i), NS, payload_for(key(i), SIZE))
    victim = cl.masters()[0]
    assert redis.Redis(port=victim, socket_timeout=5).wait(1, 5000) == 1, "its replica has every write"
    from redis.cluster import RedisCluster

    from shmkv.tiers.remote.signing import chunk_key

    view = RedisCluster(host="127.0.0.1", port=victim)
    on_victim = [i for i in range(N) if view.get_node_from_key(chunk_key(key(i), NS)).port == victim]
    view.close()
    assert on_victim
    cl.kill_node(victim)
    errors = store.stats()["remote_errors"]
    live = next(i for i in range(N) if i not in on_victim)
    # a lookup of the dead shard's chunks alone is their miss, not the whole tier's backoff
    assert c.remote.contains([key(on_victim[0])], [NS]) == [False]
    assert store.stats()["remote_errors"] > errors
    assert c.remote.available and c.remote.contains([key(live)], [NS]) == [True], "the live shards answer at once"
    assert c.remote.fetch(key(on_victim[0]), NS) is None  # a miss, not an exception
    cl.wait_for_failover(victim)
    got = None
    for _ in range(20):  # each try waits out the tier's backoff first (a bound, not a guess)
        deadline = time.monotonic() + 60
        while not c.remote.available and time.monotonic() < deadline:
            time.sleep(0.05)  # the backoff's own clock: polled, bounded
        got = c.remote.fetch(key(on_victim[0]), NS)
        if got is not None:
            break
    assert got == (payload_for(key(on_victim[0]), SIZE), NS), "the promoted replica serves the chunk"
    assert c.remote.write(key("after"), NS, payload_for(key("after"), SIZE)), "writes resume"
    c.close()


@pytest.mark.slow  # over 10 s: out of the inner loop (-m "not slow"), in CI
def test_the_remote_benchmark_measures_a_server_and_a_cluster_in_one_run():
    """`python -m shmkv.bench remote --cluster --processes 2 --json`, small: both figures, from two processes."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "remote", "--cluster", "--processes", "2", "--chunks", "3",
                        "--chunk-mib", "0.5", "--repeats", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["processes"] == 2
    assert all(got[t][f] > 0 for t in ("single", "cluster") for f in ("put_gbps", "get_gbps")), got
