"""POST /compress on the chunks one vLLM engine stored, then a second engine
hits them: the KV bytes it loads equal the uncompressed chunks byte for byte,
its output equals a run without the connector at the same split, and the
shared tier holds the chunks in fewer bytes.

The lossy form (POST /compress with "form": "fp8"): the engine that stored
the chunks, exact, finds nothing any more and computes (its output as at
first), while an engine started with `lossy_form: fp8` hits them."""

from __future__ import annotations

import json

import pytest
from helpers import check_loaded_bytes_equal_stored, random_prompt

from shmkv import Store
from shmkv.config import load_config
from shmkv.keys import lossy_key
from shmkv.services.controller import Controller

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=91)


def test_a_hit_on_compressed_chunks_is_exact(cache_name, start_engine, reference, tmp_path):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    a = start_engine("compress-a", shmkv=cfg)
    assert a.generate([P])["num_cached_tokens"] == [0]

    with Store.attach(cache_name) as store:
        raw_bytes = store.stats()["bytes_used"]
        ctl = Controller(load_config(cfg, env={}), store, None)
        status, _, body = ctl.handle("POST", "/compress", b"{}")  # the one namespace registered
        reply = json.loads(body)
        assert status == 200 and reply["compressed_chunks"] == 4, reply  # 3 chunks and the 128-token piece
        assert reply["bytes_after"] < reply["bytes_before"]
        st = store.stats()
        assert st["compressed_entries"] == 4 and st["bytes_used"] < raw_bytes

        b = start_engine("compress-b", shmkv=cfg)
        r = b.generate([P])
        assert r["num_cached_tokens"] == [896]
        assert r["outputs"][0] == reference.output(P, 896)
        assert check_loaded_bytes_equal_stored(digests) == 4, "every section decoded equals what A stored"

        status, _, body = ctl.handle("POST", "/decompress", b"{}")
        assert status == 200 and json.loads(body)["decompressed_chunks"] == 4
        assert store.stats()["compressed_entries"] == 0
        assert store.check_consistency() == []


def test_lossy_chunks_reach_only_an_engine_that_opted_in(cache_name, start_engine):
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    a = start_engine("lossy-a", shmkv=cfg)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0]

    with Store.attach(cache_name) as store:
        ctl = Controller(load_config(cfg, env={}), store, None)
        status, _, body = ctl.handle("POST", "/compress", b'{"form": "fp8"}')
        reply = json.loads(body)
        assert status == 200 and reply["compressed_chunks"] == 4, reply
        assert 0 < reply["relative_rms_error_max"] < 0.05
        lossy_root = bytes.fromhex(reply["lossy_namespace"])
        assert lossy_root == lossy_key(bytes.fromhex(reply["namespace"]), "fp8")

        again = a.generate([P])  # exact: the lossy chunks are not its keys
        assert again["num_cached_tokens"] == [0] and again["outputs"] == first["outputs"]

        c = start_engine("lossy-c", shmkv={**cfg, "lossy_form": "fp8"})
        r = c.generate([P])
        assert r["num_cached_tokens"] == [896], "the opted-in engine loads the fp8 form"
        assert len(r["outputs"][0]) == len(first["outputs"][0])
        assert store.stats()["compressed_entries"] == 4
        assert store.check_consistency() == []
