"""The controller API, endpoint by endpoint, against a daemon served in this
process (HTTP on loopback, and a 0600 unix socket): what each answers, what
it changes, and that a malformed or out-of-range request gets a 4xx with a
message and changes nothing."""

from __future__ import annotations

import os
import stat

import pytest
from helpers import http, payload_for, serve_in_process, stop_in_process

from shmkv import Store
from shmkv.chunking import Chunker
from shmkv.config import load_config
from shmkv.keys import Namespace
from shmkv.namespaces import namespace_to_dict, register

CHUNK, BLOCK, NBYTES = 32, 16, 4096
NS = Namespace(model_id="test-model", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
               chunk_size=CHUNK, block_size=BLOCK)
OTHER = Namespace(model_id="other-model", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                  chunk_size=CHUNK, block_size=BLOCK)
TOKENS = list(range(1000, 1112))  # 3 chunks of 32 and a tail piece of 16


def units(ns=NS, tokens=TOKENS):
    return Chunker([ns.root_key()], ns.chunk_size, BLOCK).units(tokens)


def start_daemon(cache_name, tmp_path, listen="127.0.0.1:0", disk=True, remote=""):
    cfg = load_config({"cache_name": cache_name, "capacity": "8MiB", "chunk_size": CHUNK, "listen": listen,
                       "disk_dir": str(tmp_path / "disk") if disk else "", "populate": False,
                       "spill_ahead": 0.0, "low_watermark": 0.0, "remote_url": remote})
    return serve_in_process(cfg)


@pytest.fixture
def served(cache_name, tmp_path):
    d, t = start_daemon(cache_name, tmp_path)
    register(cache_name, NS)
    yield d
    stop_in_process(d, t)


def put_units(store, us, ns=NS):
    for u in us:
        store.put(u.keys[0], payload_for(u.keys[0], NBYTES), namespace=ns.root_key())


def state(d):
    st = d.store.stats()
    disk = d.role.disk
    return st["entries"], st["bytes_used"], st["pinned_entries"], sorted(os.listdir(disk.dir)) if disk else None


def test_health_stats_metrics_namespaces(served):
    st, body = http(served.url, "GET", "/health")
    assert st == 200 and body["status"] == "ok" and body["cache"] == served.store.name
    assert body["pid"] == os.getpid() and body["disk_tier"].endswith(served.store.name)
    put_units(served.store, units()[:2])
    st, body = http(served.url, "GET", "/stats")
    assert st == 200 and body["shm"]["puts"] == 2 and body["shm"]["entries"] == 2
    assert body["disk"]["files"] == 0 and body["controller"]["requests"] >= 1
    assert body["disk"]["codec"]["setting"] == "auto" and body["disk"]["codec"]["choice"] in ("zstd", "none")
    st, text = http(served.url, "GET", "/metrics")
    assert st == 200
    assert "# HELP shmkv_puts_total Chunks written to the tier (shm: committed; disk: spilled; remote: written)" in text
    assert f'shmkv_puts_total{{cache="{served.store.name}",tier="shm"}} 2.0' in text
    assert f'shmkv_puts_total{{cache="{served.store.name}",tier="disk"}} 0.0' in text
    assert "shmkv_controller_requests_total" in text
    st, body = http(served.url, "GET", "/namespaces")
    assert st == 200 and body["namespaces"] == [{"root": NS.root_key().hex(), **namespace_to_dict(NS)}]


def test_lookup_reports_each_tier_in_prefix_order(served):
    us = units()
    assert [(u.start, u.end) for u in us] == [(0, 32), (32, 64), (64, 96), (96, 112)]
    put_units(served.store, [us[0], us[1], us[3]])
    served.role.disk.write(us[2].keys[0], NS.root_key(), payload_for(us[2].keys[0], NBYTES))
    for ns in (NS.root_key().hex(), namespace_to_dict(NS)):  # by registered root, or by fields
        st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": ns})
        assert st == 200, body
        assert body["cached_tokens"] == 112 and body["tiers"] == {"shm": 80, "disk": 32, "remote": 0}
        assert [c["tier"] for c in body["chunks"]] == ["shm", "shm", "disk", "shm"]
    # another namespace, or another prefix, shares nothing
    st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": namespace_to_dict(OTHER)})
    assert body["cached_tokens"] == 0
    st, body = http(served.url, "POST", "/lookup", {"tokens": [7] + TOKENS[1:], "namespace": NS.root_key().hex()})
    assert body["cached_tokens"] == 0
    assert served.store.stats()["lookups"] == 0, "controller lookups do not count as cache traffic"


def test_the_only_registered_namespace_may_be_left_out(served, cache_name):
    put_units(served.store, units()[:2])
    st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS})
    assert st == 200 and body["namespace"] == NS.root_key().hex() and body["cached_tokens"] == 64
    register(cache_name, OTHER)
    st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS})
    assert st == 400 and "namespace: required (2 namespaces are registered" in body["error"]


def test_lookup_by_unregistered_root_uses_given_geometry(served):
    put_units(served.store, units(OTHER))
    root = OTHER.root_key().hex()
    st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": root})
    assert st == 200 and body["cached_tokens"] == 96, "default: full chunks of the daemon's chunk_size"
    st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": root, "block_size": BLOCK})
    assert body["cached_tokens"] == 112, "with block_size, the tail piece too"


def test_clear_one_namespace_then_everything(served):
    put_units(served.store, units(NS))
    put_units(served.store, units(OTHER), ns=OTHER)
    disk = served.role.disk
    for ns in (NS, OTHER):
        k = units(ns)[0].keys[0]
        served.role.maintainer.spill(k, ns.root_key())
    st, body = http(served.url, "POST", "/clear", {"namespace": NS.root_key().hex()})
    assert st == 200 and body["removed"] == {"shm": 4, "disk": 1, "remote": 0}
    assert not any(served.store.contains([u.keys[0] for u in units(NS)]))
    assert all(served.store.contains([u.keys[0] for u in units(OTHER)]))
    assert disk.contains([units(OTHER)[0].keys[0]]) == [True]
    st, body = http(served.url, "POST", "/clear", {})
    assert st == 200 and body["removed"] == {"shm": 4, "disk": 1, "remote": 0}
    assert served.store.stats()["entries"] == 0 and os.listdir(disk.dir) == []


def test_pin_keeps_chunks_through_pressure_and_from_disk(served):
    us = units()
    put_units(served.store, us)
    store, disk = served.store, served.role.disk
    served.role.maintainer.spill(us[1].keys[0], NS.root_key())
    assert store.evict_spilled(us[1].keys[0]), "chunk 1 now only on disk"
    st, body = http(served.url, "POST", "/pin", {"tokens": TOKENS, "namespace": NS.root_key().hex()})
    assert st == 200 and body == {"pinned_chunks": 4, "pinned_tokens": 112}, "chunk 1 promoted, then pinned"
    assert store.get(us[1].keys[0]) == payload_for(us[1].keys[0], NBYTES)
    before_disk = set(os.listdir(disk.dir))
    assert served.role.maintainer.spill_all() == (0, 0), "pinned chunks are not spilled (nor owed to disk)"
    assert set(os.listdir(disk.dir)) == before_disk
    # fill the tier many times over: pinned chunks stay
    for i in range(3 * store.arena_bytes // NBYTES):
        store.put(i.to_bytes(16, "little"), b"f" * NBYTES)
    assert all(store.contains([u.keys[0] for u in us]))
    st, body = http(served.url, "POST", "/unpin", {"tokens": TOKENS, "namespace": NS.root_key().hex()})
    assert st == 200 and body == {"unpinned_chunks": 4}
    assert store.stats()["pinned_entries"] == 0
    served.role.maintainer.spill_all()  # unpinned chunks are owed to disk before memory lets them go
    for i in range(3 * store.arena_bytes // NBYTES):
        store.put((10**6 + i).to_bytes(16, "little"), b"f" * NBYTES)
    assert not any(store.contains([u.keys[0] for u in us])), "unpinned (and on disk): evictable again"


def test_move_to_disk_and_back(served):
    us = units()
    put_units(served.store, us)
    ns = NS.root_key().hex()
    st, body = http(served.url, "POST", "/move", {"tokens": TOKENS, "namespace": ns, "to": "disk"})
    assert st == 200 and body["moved_chunks"] == 4 and body["tiers"] == {"shm": 0, "disk": 112, "remote": 0}
    assert not any(served.store.contains([u.keys[0] for u in us]))
    st, body = http(served.url, "POST", "/move", {"tokens": TOKENS, "namespace": ns, "to": "shm"})
    assert st == 200 and body["moved_chunks"] == 4 and body["tiers"] == {"shm": 112, "disk": 0, "remote": 0}
    for u in us:
        assert served.store.get(u.keys[0]) == payload_for(u.keys[0], NBYTES)


def test_flush_puts_every_chunk_on_disk(served):
    us = units()
    put_units(served.store, us)
    st, body = http(served.url, "POST", "/flush", {})
    assert st == 200 and body == {"spilled_chunks": 4, "synced_files": 4}
    disk = served.role.disk
    assert disk.contains([u.keys[0] for u in us]) == [True] * 4
    for u in us:
        assert disk.read(u.keys[0]) == payload_for(u.keys[0], NBYTES)
    st, body = http(served.url, "POST", "/flush")
    assert st == 200 and body["spilled_chunks"] == 0, "already on disk"


def test_flush_waits_for_the_remote_tier(cache_name, tmp_path, redis_server):
    from shmkv.tiers.remote.signing import chunk_key

    d, t = start_daemon(cache_name, tmp_path, remote=redis_server.url)
    register(cache_name, NS)
    try:
        us = units()
        put_units(d.store, us)
        st, body = http(d.url, "POST", "/flush", {})
        assert st == 200 and body == {"spilled_chunks": 4, "synced_files": 4, "remote_flushed": True}
        client = redis_server.client()
        assert all(client.exists(chunk_key(u.keys[0], NS.root_key())) for u in us)
        st, body = http(d.url, "GET", "/health")
        assert body["remote_tier"] == redis_server.url
        # the remote is a tier of lookups and clears too
        d.store.clear()
        d.role.disk.clear()
        st, body = http(d.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": NS.root_key().hex()})
        assert body["tiers"] == {"shm": 0, "disk": 0, "remote": 112}, body
        st, body = http(d.url, "POST", "/move", {"tokens": TOKENS, "namespace": NS.root_key().hex(), "to": "shm"})
        assert body["tiers"] == {"shm": 112, "disk": 0, "remote": 0} and body["moved_chunks"] == 4, body
        st, body = http(d.url, "POST", "/clear", {"namespace": NS.root_key().hex()})
        assert body["removed"] == {"shm": 4, "disk": 0, "remote": 4}, body
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()


BAD = [
    ("GET", "/nothing-here", None, 404, "no endpoint"),
    ("GET", "/lookup", None, 405, "takes POST"),
    ("POST", "/health", {}, 405, "takes GET"),
    ("POST", "/lookup", b"{not json", 400, "not valid JSON"),
    ("POST", "/lookup", [1, 2], 400, "JSON object"),
    ("POST", "/lookup", {"namespace": "ns"}, 400, "tokens"),
    ("POST", "/lookup", {"tokens": "1 2 3", "namespace": "00" * 16}, 400, "tokens"),
    ("POST", "/lookup", {"tokens": [1, -2], "namespace": "00" * 16}, 400, "tokens[1]"),
    ("POST", "/lookup", {"tokens": [1, 2**32], "namespace": "00" * 16}, 400, "tokens[1]"),
    ("POST", "/lookup", {"tokens": [1, 2.5], "namespace": "00" * 16}, 400, "tokens[1]"),
    ("POST", "/lookup", {"tokens": [True], "namespace": "00" * 16}, 400, "tokens[0]"),
    ("POST", "/lookup", {"tokens": [1], "namespace": "abc"}, 400, "32 hex digits"),
    ("POST", "/lookup", {"tokens": [1], "namespace": 17}, 400, "namespace"),
    ("POST", "/lookup", {"tokens": [1], "namespace": {"model_id": "m"}}, 400, "missing field"),
    ("POST", "/lookup", {"tokens": [1], "namespace": {**namespace_to_dict(NS), "color": 1}}, 400, "color"),
    ("POST", "/lookup", {"tokens": [1], "namespace": {**namespace_to_dict(NS), "num_layers": "2"}}, 400,
     "num_layers"),
    ("POST", "/lookup", {"tokens": [1], "namespace": {**namespace_to_dict(NS), "chunk_size": 0}}, 400,
     "chunk_size"),
    ("POST", "/lookup", {"tokens": [1], "namespace": "00" * 16, "chunk_size": 0}, 400, "chunk_size"),
    ("POST", "/lookup", {"tokens": [1], "namespace": "00" * 16, "chunk_size": 32, "block_size": 12}, 400,
     "multiple"),
    ("POST", "/lookup", {"tokens": [1], "namespace": "00" * 16, "speed": "fast"}, 400, "speed"),
    ("POST", "/clear", {"namespace": "zz" * 16}, 400, "hex"),
    ("POST", "/clear", {"everything": True}, 400, "everything"),
    ("POST", "/pin", {"tokens": [1, None], "namespace": "00" * 16}, 400, "tokens[1]"),
    ("POST", "/unpin", {"tokens": [1], "namespace": [1]}, 400, "namespace"),
    ("POST", "/move", {"tokens": TOKENS, "namespace": "00" * 16, "to": "gpu"}, 400, "to="),
    ("POST", "/move", {"tokens": TOKENS, "namespace": "00" * 16}, 400, "to: required"),
    ("POST", "/flush", {"now": 1}, 400, "now"),
]


@pytest.mark.parametrize("method,path,body,status,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_change_nothing(served, method, path, body, status, words):
    us = units()
    put_units(served.store, us[:2])
    served.role.maintainer.spill(us[0].keys[0], NS.root_key())
    before = state(served)
    raw = body if isinstance(body, bytes) else None
    st, reply = http(served.url, method, path, None if raw else body, raw=raw)
    assert st == status, reply
    assert words in reply["error"], reply
    assert state(served) == before


def test_oversized_or_unframed_bodies_are_refused(served):
    # NOTE: no body bytes after these heads: the server answers from the head alone (it never waits for
    # the gigabyte), then closes; bytes it left unread would make the kernel reset the connection, and
    # the client could lose the answer it was reading
    st, reply = http(served.url, "POST", "/lookup", raw=b"", headers={"Content-Length": str(1 << 30)})
    assert st == 413 and "over the limit" in reply["error"]
    st, reply = http(served.url, "POST", "/lookup", raw=b"", headers={"Content-Length": "lots"})
    assert st == 400
    st, reply = http(served.url, "POST", "/lookup", {"tokens": [1] * ((1 << 20) + 1), "namespace": "00" * 16})
    assert st == 413 and "limit" in reply["error"]
    st, body = http(served.url, "GET", "/stats")
    assert body["controller"]["bad_requests"] == 3 and body["controller"]["errors"] == 0


def test_compress_then_decompress(served):
    us = units()
    put_units(served.store, us)
    put_units(served.store, units(OTHER), ns=OTHER)
    register(served.store.name, OTHER)
    raw = {u.keys[0]: served.store.get(u.keys[0]) for u in us}
    # the cached prefix of the first 64 tokens only: two chunks
    st, body = http(served.url, "POST", "/compress", {"namespace": NS.root_key().hex(), "tokens": TOKENS[:64]})
    assert st == 200 and body["compressed_chunks"] == 2 and body["bytes_after"] * 4 < body["bytes_before"], body
    st, body = http(served.url, "POST", "/compress", {"namespace": NS.root_key().hex()})  # the whole namespace
    assert st == 200 and body["compressed_chunks"] == 2 and body["skipped"] == {"already": 2}, body
    st, stats = http(served.url, "GET", "/stats")
    assert stats["shm"]["compressed_entries"] == 4 and 0 < stats["shm"]["compressed_bytes"] < 4 * NBYTES
    st, text = http(served.url, "GET", "/metrics")
    assert f'shmkv_compressed_entries{{cache="{served.store.name}",tier="shm"}} 4.0' in text
    st, body = http(served.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": NS.root_key().hex()})
    assert body["tiers"]["shm"] == len(TOKENS), "compressed chunks are still cached"
    assert all(served.role.maintainer.chain.shared.fetch(k, NS.root_key())[0] == v for k, v in raw.items())
    other = [u.keys[0] for u in units(OTHER)]
    assert not any(e["flags"] & 2 for e in served.store.entries() if e["key"] in other), "other namespaces untouched"

    st, body = http(served.url, "POST", "/decompress", {"namespace": NS.root_key().hex(), "tokens": TOKENS})
    assert st == 200 and body["decompressed_chunks"] == 4 and body["bytes_after"] == 4 * NBYTES
    assert served.store.stats()["compressed_entries"] == 0
    assert all(served.store.get(k) == v for k, v in raw.items())
    assert served.store.check_consistency() == []


@pytest.mark.parametrize("body,words", [
    ({"tokens": "all"}, "tokens"),
    ({"lossy": "fp8"}, "unknown field 'lossy'"),
    ({"namespace": "00" * 16, "tokens": [1, -1]}, "tokens[1]"),
])
def test_bad_compress_requests(served, body, words):
    put_units(served.store, units())
    st, reply = http(served.url, "POST", "/compress", body)
    assert st == 400 and words in reply["error"], reply
    assert served.store.stats()["compressed_entries"] == 0


def test_move_and_flush_need_a_disk_tier(cache_name, tmp_path):
    d, t = start_daemon(cache_name, tmp_path, disk=False)
    try:
        st, reply = http(d.url, "POST", "/flush", {})
        assert st == 409 and "--disk-dir" in reply["error"]
        st, reply = http(d.url, "POST", "/move", {"tokens": TOKENS, "namespace": "00" * 16, "to": "disk"})
        assert st == 409
        st, reply = http(d.url, "POST", "/lookup", {"tokens": TOKENS, "namespace": "00" * 16})
        assert st == 200 and reply["tiers"] == {"shm": 0, "disk": 0, "remote": 0}
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()


def test_unix_socket_is_private(cache_name, tmp_path):
    sock = tmp_path / "run" / "ctl.sock"
    sock.parent.mkdir()
    old = os.umask(0)
    try:
        d, t = start_daemon(cache_name, tmp_path, listen=f"unix:{sock}")
    finally:
        os.umask(old)
    try:
        assert d.url == f"unix:{sock}"
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        st, body = http(d.url, "GET", "/health")
        assert st == 200 and body["cache"] == cache_name
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()
    assert not sock.exists(), "the socket file goes with the daemon"
    assert Store.attach(cache_name).stats()["capacity_bytes"] > 0, "the segment stays"
