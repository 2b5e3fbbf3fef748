"""The daemon beside a running vLLM engine: the engine's namespace is listed,
the controller sees what the engine stored, restarting the daemon does not
disturb the engine or lose chunks, and clear / move act on what vLLM gets."""

from __future__ import annotations

import pytest
from helpers import http, random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow


def test_controller_beside_vllm(cache_name, start_engine, reference, daemon, tmp_path, model_dir):
    disk_dir = str(tmp_path / "disk")
    args = ("--capacity", "64MiB", "--disk-dir", disk_dir, "--listen", "127.0.0.1:0")
    d = daemon(cache_name, *args)
    e = start_engine("beside-daemon", shmkv={"cache_name": cache_name, "capacity": "64MiB", "disk_dir": disk_dir})
    a, b = random_prompt(700, seed=81), random_prompt(700, seed=82)
    assert e.generate([a])["num_cached_tokens"] == [0]

    st, body = http(d.url, "GET", "/namespaces")
    assert st == 200 and len(body["namespaces"]) == 1
    ns = body["namespaces"][0]
    assert ns["model_id"] == model_dir and ns["chunk_size"] == 256 and ns["block_size"] == 128
    st, body = http(d.url, "POST", "/lookup", {"tokens": a, "namespace": ns["root"]})
    assert st == 200 and body["cached_tokens"] == 640 and body["tiers"]["shm"] == 640, body

    # restart the daemon under the running engine
    assert d.stop() == 0
    d = daemon(cache_name, *args)
    assert e.generate([b])["num_cached_tokens"] == [0]
    r = e.generate([a])
    assert r["num_cached_tokens"] == [640] and r["outputs"][0] == reference.output(a, 640)

    # push b's chunks out to disk: the engine then hits them from disk
    st, body = http(d.url, "POST", "/move", {"tokens": b, "namespace": ns["root"], "to": "disk"})
    assert st == 200 and body["tiers"] == {"shm": 0, "disk": 640, "remote": 0}, body
    with Store.attach(cache_name) as s:
        hits_before = s.stats()["disk_hits"]
        r = e.generate([b])
        assert r["num_cached_tokens"] == [640] and r["outputs"][0] == reference.output(b, 640)
        assert s.stats()["disk_hits"] - hits_before == 3

    # clear the engine's namespace: nothing left to hit
    st, body = http(d.url, "POST", "/clear", {"namespace": ns["root"]})
    assert st == 200 and body["removed"]["shm"] >= 6, body
    st, body = http(d.url, "POST", "/lookup", {"tokens": a, "namespace": ns["root"]})
    assert body["cached_tokens"] == 0
    assert e.generate([a])["num_cached_tokens"] == [0]
    assert d.stop() == 0
