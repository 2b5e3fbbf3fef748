"""A misconfigured or hostile member of a fleet sharing one Redis cannot make
the fleet's signed chunks unreadable: a host with another secret writes,
budgets and clears only its own names; a host whose clock runs ten minutes
ahead judges expiry in the server's clock and removes nothing alive; a Redis
writer without the secret who erases, forges or rolls back the clear
generations is healed by the signed values themselves. In each case every
fleet chunk is read by a host of the fleet before and after (counts equal)."""

from __future__ import annotations

import time

import pytest
from helpers import key, payload_for

from shmkv.config import load_config
from shmkv.tiers import open_tiers
from shmkv.tiers.remote import signing as remote_signing
from shmkv.tiers.remote.signing import chunk_key, key_id

NS = b"N" * 16
SIZE = 16 * 1024
FLEET = range(40, 46)
SECRET = b"the fleet's secret, 32 bytes...."
OTHER = b"a typo'd secret of 32 bytes....."


@pytest.fixture
def store(small_store):
    return small_store


def host(store, url, tmp_path, secret=SECRET, **settings):
    p = tmp_path / f"secret-{key_id(secret).hex()}"
    p.write_bytes(secret)
    p.chmod(0o600)
    return open_tiers(load_config({"cache_name": store.name, "remote_url": url, "remote_secret_file": str(p),
                                   "remote_timeout": 5, "remote_ttl": 3600, **settings}, env={}), store).remote


def write_fleet(tier) -> None:
    for i in FLEET:
        assert tier.write(key(i), NS, payload_for(key(i), SIZE))


def readable(tier) -> int:
    """How many fleet chunks `tier` reads back, byte for byte."""
    return sum(tier.fetch(key(i), NS) == (payload_for(key(i), SIZE), NS) for i in FLEET)


def readable_by_a_new_host(store, url, tmp_path) -> int:
    """readable() by a fleet host that starts now (it has seen nothing)."""
    tier = host(store, url, tmp_path)
    try:
        return readable(tier)
    finally:
        tier.close()


def test_a_host_with_another_secret_leaves_every_fleet_chunk_readable(store, redis_server, tmp_path):
    fleet = host(store, redis_server.url, tmp_path)
    write_fleet(fleet)
    before = readable_by_a_new_host(store, redis_server.url, tmp_path)
    stray = host(store, redis_server.url, tmp_path, secret=OTHER, remote_capacity=2 * SIZE)  # a small budget too
    for i in [*FLEET, *range(60, 70)]:  # the fleet's keys and more: its budget evicts
        assert stray.write(key(i), NS, payload_for(key(99), SIZE))
    assert stray.clear(NS) > 0 and stray.clear() >= 0
    after = readable_by_a_new_host(store, redis_server.url, tmp_path)
    assert (before, after) == (len(FLEET), len(FLEET))
    assert readable(fleet) == len(FLEET)


def test_a_host_whose_clock_runs_ten_minutes_ahead_removes_nothing_alive(store, redis_server, tmp_path, monkeypatch):
    fleet = host(store, redis_server.url, tmp_path, remote_ttl=300)  # values expire 5 minutes on
    write_fleet(fleet)
    before = readable_by_a_new_host(store, redis_server.url, tmp_path)
    client = redis_server.client()
    names = [chunk_key(key(i), NS, key_id(SECRET)) for i in FLEET]
    monkeypatch.setattr(remote_signing, "_now", lambda: time.time() + 600)
    ahead = host(store, redis_server.url, tmp_path)
    assert readable(ahead) == len(FLEET), "judged in the server's clock: none expired"
    assert ahead.write(key(70), NS, payload_for(key(70), SIZE))
    monkeypatch.undo()
    assert all(client.exists(n) for n in names)
    assert store.stats()["remote_expired"] == 0
    after = readable_by_a_new_host(store, redis_server.url, tmp_path)
    assert (before, after) == (len(FLEET), len(FLEET))
    assert fleet.fetch(key(70), NS) is not None, "what the host ahead wrote is not expired for the others"


@pytest.mark.parametrize("attack", ["erased", "forged", "rolled_back"])
def test_a_redis_writer_without_the_secret_cannot_undo_the_clear_generations(store, redis_server, tmp_path,
                                                                             monkeypatch, attack):
    """The fleet cleared twice, then wrote its chunks (signed under
    generation 2). Someone who can write to the Redis erases the record,
    forges it, or writes back the one of generation 1: a host that never saw
    the record reads every chunk (the signed generation proves the clear),
    writes the record back (counted), and a value from before the clear is
    still stale."""
    monkeypatch.setattr(remote_signing, "GEN_REFRESH_S", 0.0)
    fleet = host(store, redis_server.url, tmp_path)
    client = redis_server.client()
    assert fleet.write(key(80), NS, payload_for(key(80), SIZE))
    before_clear = client.get(chunk_key(key(80), NS, key_id(SECRET)))
    fleet.clear()
    record = fleet._gen_key(None)
    generation_1 = client.get(record)
    fleet.clear()
    write_fleet(fleet)
    before = readable_by_a_new_host(store, redis_server.url, tmp_path)
    if attack == "erased":
        client.delete(*client.keys(b"shmkv:v1:m:gen:*"))
    elif attack == "forged":
        client.set(record, (9).to_bytes(8, "big") + b"\0" * 16)
    else:
        client.set(record, generation_1)
    fresh = host(store, redis_server.url, tmp_path)
    after = readable(fresh)
    assert (before, after) == (len(FLEET), len(FLEET))
    assert store.stats()["remote_healed"] >= 1
    assert fresh._gen_parse(record, client.get(record)) == 2, "the record written back"
    client.set(chunk_key(key(80), NS, key_id(SECRET)), before_clear)
    assert fresh.fetch(key(80), NS) is None and store.stats()["remote_stale"] == 1
