"""With a shared secret (`remote_secret_file`) every remote chunk carries an
HMAC of it and the id of the key that signed it, and its name carries that
key id: hosts holding the secret share chunks; a value of our key id whose
MAC fails (a wrong MAC, another key's value moved) is a miss, counted and
unlinked; a value under our names without our key id (no head at all) was
planted: a miss, counted, unlinked; a host whose secret differs says so once
at start and never touches the others' names; a value written back after the expiry its writer signed, or after a
clear of everything or of its namespace, is a miss and removed; hosts with
and without the secret never see each other's chunks.
Without a secret the start-up log says that anyone who can write to the
remote can plant KV."""

from __future__ import annotations

import logging
import os
import time

import pytest
from helpers import key, payload_for

from shmkv import PutResult
from shmkv.config import load_config
from shmkv.errors import ConfigError, PermissionDeniedError
from shmkv.tiers import TierChain, open_tiers
from shmkv.tiers import format as fmt
from shmkv.tiers.remote import signing as remote_signing
from shmkv.tiers.remote.client import read_secret
from shmkv.tiers.remote.signing import KEY_ID_BYTES, MAC_BYTES, SIGNED_HEAD, chunk_key, key_id

NS = b"N" * 16
SIZE = 16 * 1024


@pytest.fixture
def store(small_store):
    return small_store


SECRET = b"0123456789abcdef0123456789abcdef"
SIGNER = key_id(SECRET)


def secret_file(tmp_path, name="secret", data=SECRET, mode=0o600):
    p = tmp_path / name
    p.write_bytes(data)
    os.chmod(p, mode)
    return str(p)


def chain(store, url, secret="", **settings):
    return open_tiers(load_config({"cache_name": store.name, "remote_url": url, "remote_secret_file": secret,
                                   "remote_timeout": 5, **settings}, env={}), store)


def stored(store, i):
    assert store.put(key(i), payload_for(key(i), SIZE), namespace=NS) is PutResult.OK


def test_hosts_with_the_secret_share_chunks(store, redis_server, tmp_path):
    c = chain(store, redis_server.url, secret_file(tmp_path))
    stored(store, 1)
    assert c.remote.write(key(1), NS, payload_for(key(1), SIZE))
    raw = redis_server.client().get(chunk_key(key(1), NS, SIGNER))
    assert raw is not None and raw[:KEY_ID_BYTES] == key_id(SECRET), "the id of the key that signed it"
    assert raw[SIGNED_HEAD:SIGNED_HEAD + 8] == fmt.MAGIC, "the key id, the expiry, the MAC, then the chunk"
    assert not redis_server.client().exists(chunk_key(key(1), NS)), "not under the unauthenticated name"
    assert c.remote.fetch(key(1), NS) == (payload_for(key(1), SIZE), NS)
    c.close()


@pytest.mark.parametrize("forge", ["wrong_mac", "moved"])
def test_a_value_of_our_key_whose_mac_fails_is_a_counted_miss_and_unlinked(store, redis_server, tmp_path, forge):
    c = chain(store, redis_server.url, secret_file(tmp_path))
    client = redis_server.client()
    victim = chunk_key(key(2), NS, SIGNER)
    good = fmt.encode(key(2), NS, payload_for(key(2), SIZE))
    if forge == "wrong_mac":
        client.set(victim, key_id(SECRET) + bytes(8) + b"\0" * MAC_BYTES + good)
    else:  # a genuine value of another key, copied under this key's name
        assert c.remote.write(key(3), NS, payload_for(key(2), SIZE))
        client.set(victim, client.get(chunk_key(key(3), NS, SIGNER)))
    assert c.remote.contains([key(2)], [NS]) == [True]
    assert c.promote([key(2)], [NS]) == 0
    assert store.stats()["remote_damaged"] == 1 and not client.exists(victim)
    c.close()


def test_a_value_under_our_name_without_our_key_id_is_a_counted_miss_and_unlinked(store, redis_server, tmp_path):
    c = chain(store, redis_server.url, secret_file(tmp_path))
    client = redis_server.client()
    victim = chunk_key(key(2), NS, SIGNER)
    client.set(victim, fmt.encode(key(2), NS, payload_for(key(2), SIZE)))  # no head: only we write our names
    assert c.promote([key(2)], [NS]) == 0
    assert (store.stats()["remote_foreign"], store.stats()["remote_damaged"]) == (1, 0)
    assert not client.exists(victim)
    c.close()


def test_a_host_with_another_secret_never_touches_the_others_names(store, redis_server, tmp_path, caplog):
    """A stale secret mid-rotation, or a typo: host B misses A's chunks,
    writes its own under its own names, and says so once at start."""
    a = chain(store, redis_server.url, secret_file(tmp_path))
    for i in range(5):
        assert a.remote.write(key(10 + i), NS, payload_for(key(10 + i), SIZE))
    client = redis_server.client()
    ours = sorted(client.keys(b"shmkv:v1:s:" + SIGNER.hex().encode() + b":*"))
    before = [client.get(k) for k in ours]
    with caplog.at_level(logging.WARNING, logger="shmkv.remote"):
        b = chain(store, redis_server.url, secret_file(tmp_path, "other", b"another secret, 32 bytes long..."))
        assert [b.remote.fetch(key(10 + i), NS) for i in range(5)] == [None] * 5
        assert b.remote.write(key(10), NS, payload_for(key(99), SIZE)), "its own chunk, under its own name"
    assert len(ours) == 5 and [client.get(k) for k in ours] == before, "every chunk of A as it was"
    assert store.stats()["remote_foreign"] == 0 and store.stats()["remote_damaged"] == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("sign with another remote_secret_file" in w for w in warnings) == 1, warnings
    assert all(SECRET.decode() not in w for w in warnings)
    assert a.promote([key(10)], [NS]) == 1, "A still reads its own"
    a.close()
    b.close()


def test_a_value_written_back_after_its_signed_expiry_is_a_miss(store, redis_server, tmp_path, monkeypatch):
    """A value captured while it lived (remote_ttl) and written back later,
    without its TTL, does not come back."""
    c = chain(store, redis_server.url, secret_file(tmp_path), remote_ttl=60)
    client = redis_server.client()
    assert c.remote.write(key(7), NS, payload_for(key(7), SIZE))
    rkey = chunk_key(key(7), NS, SIGNER)
    captured = client.get(rkey)
    client.set(rkey, captured)  # written back with no TTL
    now = time.time()
    monkeypatch.setattr(remote_signing, "_now", lambda: now + 120)  # two minutes on: past the signed expiry
    assert c.remote.fetch(key(7), NS) is None
    assert store.stats()["remote_expired"] == 1 and not client.exists(rkey)
    c.close()


def test_with_and_without_the_secret_never_meet(store, redis_server, tmp_path):
    plain, mac = chain(store, redis_server.url), chain(store, redis_server.url, secret_file(tmp_path))
    assert plain.remote.write(key(4), NS, payload_for(key(4), SIZE))
    assert mac.remote.write(key(5), NS, payload_for(key(5), SIZE))
    assert plain.remote.contains([key(4), key(5)], [NS, NS]) == [True, False]
    assert mac.remote.contains([key(4), key(5)], [NS, NS]) == [False, True]
    assert store.stats()["remote_damaged"] == 0
    assert plain.remote.clear(NS) == 1, "a host without the secret clears only the unauthenticated names"
    assert mac.remote.contains([key(5)], [NS]) == [True]
    assert plain.remote.write(key(4), NS, payload_for(key(4), SIZE))
    assert mac.remote.clear(NS) == 2, "a host with it clears its own names and the unauthenticated ones"
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


def test_a_value_written_back_after_a_clear_is_a_miss(store, redis_server, tmp_path):
    """Captured before /clear (everything) or before a namespace's clear
    (vLLM's reset_prefix_cache), written back after it: stale, removed.
    Chunks written after the clear are served as usual."""
    c = chain(store, redis_server.url, secret_file(tmp_path))
    client = redis_server.client()
    for i, ns in ((20, NS), (21, b"M" * 16)):
        assert c.remote.write(key(i), ns, payload_for(key(i), SIZE))
    captured = {i: client.get(chunk_key(key(i), ns, SIGNER)) for i, ns in ((20, NS), (21, b"M" * 16))}
    assert c.remote.clear(NS) == 1
    rk = chunk_key(key(20), NS, SIGNER)
    client.set(rk, captured[20])
    assert c.remote.fetch(key(20), NS) is None and not client.exists(rk)
    assert store.stats()["remote_stale"] == 1
    assert c.remote.fetch(key(21), b"M" * 16) is not None, "another namespace's clear generation did not move"
    assert c.remote.clear() == 1  # everything
    rk = chunk_key(key(21), b"M" * 16, SIGNER)
    client.set(rk, captured[21])
    assert c.remote.fetch(key(21), b"M" * 16) is None and store.stats()["remote_stale"] == 2
    assert c.remote.write(key(22), NS, payload_for(key(22), SIZE))
    assert c.remote.fetch(key(22), NS) == (payload_for(key(22), SIZE), NS)
    assert store.stats()["remote_damaged"] == 0
    c.close()


def test_another_hosts_clear_is_seen_and_a_rolled_back_generation_heals(store, redis_server, tmp_path, monkeypatch,
                                                                       caplog):
    """Host B clears: host A, which read the generations before, misses the
    written-back value once its view is GEN_REFRESH_S old (0 here). A
    generation record replayed from before the clear is written back by the
    hosts that saw the newer one (one WARNING), and the stale value stays a
    miss there; a record without our MAC reads as no clear at all, and is
    written back the same way."""
    monkeypatch.setattr(remote_signing, "GEN_REFRESH_S", 0.0)
    a = chain(store, redis_server.url, secret_file(tmp_path))
    b = chain(store, redis_server.url, secret_file(tmp_path))
    client = redis_server.client()
    assert a.remote.write(key(30), NS, payload_for(key(30), SIZE))
    rk = chunk_key(key(30), NS, SIGNER)
    captured, gen_key = client.get(rk), a.remote._gen_key(None)
    old_record = client.get(gen_key)
    assert b.remote.clear() == 1
    client.set(rk, captured)
    assert a.remote.fetch(key(30), NS) is None and store.stats()["remote_stale"] == 1
    client.set(rk, captured)
    with caplog.at_level(logging.WARNING, logger="shmkv.remote"):
        client.set(gen_key, old_record or b"")  # replayed (or emptied): someone who can write to the Redis
        assert a.remote.fetch(key(30), NS) is None
    assert store.stats()["remote_stale"] == 2
    assert sum("went back" in r.getMessage() for r in caplog.records) == 1
    assert client.get(gen_key) != (old_record or b""), "written back"
    client.set(gen_key, (7).to_bytes(8, "big") + b"\0" * 16)  # a generation nobody with the secret signed
    client.set(rk, captured)
    assert a.remote.fetch(key(30), NS) is None, "a forged record does not undo the clear"
    a.close()
    b.close()
