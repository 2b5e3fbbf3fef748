"""With a shared secret (`remote_secret_file`) every remote chunk carries an
HMAC of it: hosts holding the secret share chunks; a value planted by anyone
else (no MAC, a wrong one, another key's) is a miss, counted and unlinked; hosts
with and without the secret never see each other's chunks. Without a secret
the start-up log says that anyone who can write to the remote can plant KV."""

from __future__ import annotations

import logging
import os

import pytest
from helpers import key, payload_for

from shmkv import PutResult
from shmkv.config import load_config
from shmkv.errors import ConfigError, PermissionDeniedError
from shmkv.tiers import TierChain, open_tiers
from shmkv.tiers import format as fmt
from shmkv.tiers.remote.client import read_secret
from shmkv.tiers.remote.tier import MAC_BYTES, chunk_key

NS = b"N" * 16
SIZE = 16 * 1024


@pytest.fixture
def store(small_store):
    return small_store


def secret_file(tmp_path, name="secret", data=b"0123456789abcdef0123456789abcdef", mode=0o600):
    p = tmp_path / name
    p.write_bytes(data)
    os.chmod(p, mode)
    return str(p)


def chain(store, url, secret=""):
    return open_tiers(load_config({"cache_name": store.name, "remote_url": url, "remote_secret_file": secret,
                                   "remote_timeout": 5}, env={}), store)


def stored(store, i):
    assert store.put(key(i), payload_for(key(i), SIZE), namespace=NS) is PutResult.OK


def test_hosts_with_the_secret_share_chunks(store, redis_server, tmp_path):
    c = chain(store, redis_server.url, secret_file(tmp_path))
    stored(store, 1)
    assert c.remote.write(key(1), NS, payload_for(key(1), SIZE))
    raw = redis_server.client().get(chunk_key(key(1), NS, authenticated=True))
    assert raw is not None and raw[MAC_BYTES:MAC_BYTES + 8] == fmt.MAGIC, "the MAC, then the chunk"
    assert not redis_server.client().exists(chunk_key(key(1), NS)), "not under the unauthenticated name"
    assert c.remote.fetch(key(1), NS) == (payload_for(key(1), SIZE), NS)
    c.close()


@pytest.mark.parametrize("forge", ["no_mac", "wrong_mac", "moved"])
def test_a_planted_chunk_is_a_counted_miss_and_unlinked(store, redis_server, tmp_path, forge):
    c = chain(store, redis_server.url, secret_file(tmp_path))
    client = redis_server.client()
    victim = chunk_key(key(2), NS, authenticated=True)
    good = fmt.encode(key(2), NS, payload_for(key(2), SIZE))
    if forge == "no_mac":
        client.set(victim, good)
    elif forge == "wrong_mac":
        client.set(victim, b"\0" * MAC_BYTES + good)
    else:  # a genuine value of another key, copied under this key's name
        assert c.remote.write(key(3), NS, payload_for(key(2), SIZE))
        client.set(victim, client.get(chunk_key(key(3), NS, authenticated=True)))
    assert c.remote.contains([key(2)], [NS]) == [True]
    assert c.promote([key(2)], [NS]) == 0
    assert store.stats()["remote_damaged"] == 1 and not client.exists(victim)
    c.close()


def test_with_and_without_the_secret_never_meet(store, redis_server, tmp_path):
    plain, mac = chain(store, redis_server.url), chain(store, redis_server.url, secret_file(tmp_path))
    assert plain.remote.write(key(4), NS, payload_for(key(4), SIZE))
    assert mac.remote.write(key(5), NS, payload_for(key(5), SIZE))
    assert plain.remote.contains([key(4), key(5)], [NS, NS]) == [True, False]
    assert mac.remote.contains([key(4), key(5)], [NS, NS]) == [False, True]
    assert store.stats()["remote_damaged"] == 0
    assert mac.remote.clear(NS) == 2, "clear removes both key spaces"
    plain.close()
    mac.close()


def test_without_a_secret_the_log_says_anyone_can_plant(store, redis_server, caplog):
    with caplog.at_level(logging.INFO, logger="shmkv.remote"):
        c = chain(store, redis_server.url)
    assert any("anyone who can write to it can plant KV" in r.getMessage() for r in caplog.records)
    c.close()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o606])
def test_a_secret_others_can_read_is_refused(tmp_path, mode):
    with pytest.raises(PermissionDeniedError, match=f"mode {mode:04o}.*chmod 600"):
        read_secret(secret_file(tmp_path, mode=mode))


def test_a_short_or_missing_secret_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="at least 16"):
        read_secret(secret_file(tmp_path, data=b"short\n"))
    with pytest.raises(ConfigError, match="cannot read it"):
        read_secret(str(tmp_path / "missing"))


def test_the_chain_gives_the_remote_its_bytes_with_a_mac(store, redis_server, tmp_path):
    """Write-through from the shared tier: the chain's source, then the MAC."""
    c = chain(store, redis_server.url, secret_file(tmp_path))
    assert isinstance(c, TierChain)
    stored(store, 6)
    assert c.remote.enqueue(key(6), NS) and c.remote.flush(timeout_s=30)
    store.delete(key(6))
    assert c.promote([key(6)], [NS]) == 1 and store.get(key(6)) == payload_for(key(6), SIZE)
    c.close()
