"""The lossy (fp8) form of chunks: the chunk format quantizes and decodes it
with every check; it lives under shmkv.keys.lossy_key, so an exact request
never looks it up and an exact worker refuses it even if handed one;
POST /compress with "form": "fp8" moves a namespace into it, and only a
planner with lossy_form finds it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.chunking import Chunker
from shmkv.config import load_config
from shmkv.errors import ConfigError
from shmkv.integration.vllm.planner import GroupWindow, LoadItem, Planner
from shmkv.keys import Namespace, chunk_keys, lossy_key
from shmkv.services.controller import Controller
from shmkv.tiers import TierChain
from shmkv.tiers import format as fmt
from shmkv.transfer import TransferEngine as KVWorker
from shmkv.transfer.layout import KVLayout

BS = 16
KEY, NSD = bytes(range(16)), b"N" * 16


def gaussian(n: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.7).to(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fp8_form_decodes_close_to_the_source_and_is_checked(dtype):
    x = gaussian(5000, getattr(torch, dtype))  # not a multiple of the scale group
    raw = x.view(torch.uint8).numpy().tobytes()
    data, err = fmt.encode_fp8(KEY, NSD, raw, dtype)
    assert len(data) < len(raw) * (0.55 if dtype != "float32" else 0.3)
    assert 0 < err < 0.05, "float8 e4m3 keeps about 2 significant digits"
    out, ns = fmt.decode(data, KEY, lossy_ok=True)
    assert ns == NSD and len(out) == len(raw)
    y = torch.frombuffer(out, dtype=x.dtype)
    measured = float((y.float() - x.float()).norm() / x.float().norm())
    assert measured == pytest.approx(err, rel=1e-6), "the error reported is that of what decoding gives"
    assert fmt.codec_of(data) == "fp8"
    with pytest.raises(fmt.DamagedChunk, match="lossy"):
        fmt.decode(data, KEY)  # an exact caller never gets lossy bytes
    bad = bytearray(data)
    bad[-1] ^= 0x01
    with pytest.raises(fmt.DamagedChunk, match="checksum"):
        fmt.decode(bytes(bad), KEY, lossy_ok=True)
    with pytest.raises(fmt.DamagedChunk):
        fmt.decode(data[:-3], KEY, lossy_ok=True)


def test_fp8_form_refuses_what_it_cannot_represent():
    x = gaussian(2048)
    x[7] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        fmt.encode_fp8(KEY, NSD, x.view(torch.uint8).numpy().tobytes(), "bfloat16")
    with pytest.raises(ValueError, match="int8"):
        fmt.encode_fp8(KEY, NSD, bytes(64), "int8")
    zeros, err = fmt.encode_fp8(KEY, NSD, bytes(4096), "bfloat16")
    assert err == 0 and fmt.decode(zeros, KEY, lossy_ok=True)[0] == bytes(4096)


def test_lossy_keys_are_apart_from_exact_ones_and_chain_exactly():
    root = b"R" * 16
    tokens = np.arange(3 * 64 + 32) % 1000
    exact = Chunker([root], 64, BS).units(tokens)
    lossy = Chunker([root], 64, BS, "fp8").units(tokens)
    assert [(u.start, u.end) for u in exact] == [(u.start, u.end) for u in lossy]
    assert [u.keys[0] for u in lossy] == [lossy_key(u.keys[0], "fp8") for u in exact], \
        "each unit, the tail piece included, is the lossy key of its exact key"
    assert not {u.keys[0] for u in exact} & {u.keys[0] for u in lossy}
    assert Chunker([root], 64, BS, "fp8").roots == (lossy_key(root, "fp8"),)
    with pytest.raises(ConfigError, match="fp4"):
        lossy_key(root, "fp4")
    with pytest.raises(ConfigError, match="lossy_form"):
        load_config({"lossy_form": "int4"}, env={})
    assert load_config({}, env={}).lossy_form == ""


NS = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, chunk_size=64,
               block_size=BS)
PROMPT = list(range(100, 100 + 3 * 64 + 2 * BS))  # 3 chunks and a 2-block piece


@pytest.fixture
def filled(cache_name):
    """The exact units of PROMPT in a store, as a worker stored them, with a
    controller over it (the namespace given as an object of fields)."""
    store = Store.create(cache_name, 32 << 20, alignment=256)
    src = make_cache("hnd", 2, 32, BS, 2, 64, torch.bfloat16, seed=3)
    g = torch.Generator().manual_seed(3)
    for t in src:
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    planner = Planner([NS], BS)
    units = planner.units(PROMPT)
    layout = KVLayout("cpu", src, block_size=BS)
    for i, u in enumerate(units):
        n = u.tokens // BS
        buf = torch.empty(layout.payload_bytes(u.tokens), dtype=torch.uint8)
        layout.gather(list(range(4 * i, 4 * i + n)), buf)
        store.put(u.keys[0], buf.numpy(), namespace=planner.roots[0], tokens=u.tokens)
    ctl = Controller(load_config({"cache_name": cache_name}, env={}), store, None)

    def post(path: str, body: dict) -> tuple[int, dict]:
        status, _, out = ctl.handle("POST", path, json.dumps({"namespace": _ns_dict(), **body}).encode())
        return status, json.loads(out)

    yield store, post, units, src
    store.close()


def _ns_dict() -> dict:
    from shmkv.namespaces import namespace_to_dict

    return namespace_to_dict(NS)


def _cached(store: Store, lossy_form: str | None) -> int:
    planner = Planner([NS], BS, lossy_form=lossy_form)
    hit, _, _ = planner.lookup(TierChain(store, []), PROMPT, planner.units(PROMPT), count=False)
    return hit


def test_compress_to_fp8_moves_a_namespace_into_its_lossy_form(filled):
    store, post, units, _ = filled
    assert _cached(store, None) == len(PROMPT) - BS  # vLLM computes the last block
    status, r = post("/compress", {"form": "fp8"})
    assert status == 200, r
    assert r["compressed_chunks"] == len(units) and r["exact_kept"] is False
    assert r["bytes_after"] < 0.55 * r["bytes_before"]
    assert 0 < r["relative_rms_error_mean"] <= r["relative_rms_error_max"] < 0.05
    assert r["lossy_namespace"] == lossy_key(NS.root_key(), "fp8").hex()
    assert _cached(store, None) == 0, "an exact request finds nothing: the exact chunks are gone"
    assert _cached(store, "fp8") == len(PROMPT) - BS, "an engine with lossy_form finds every unit"
    status, r = post("/lookup", {"tokens": PROMPT, "lossy_form": "fp8"})
    assert status == 200 and r["cached_tokens"] == len(PROMPT)
    status, r = post("/lookup", {"tokens": PROMPT})
    assert status == 200 and r["cached_tokens"] == 0
    st = store.stats()
    assert st["compressed_entries"] == len(units) and st["put_tokens"] >= 2 * len(PROMPT)
    assert store.check_consistency() == []
    status, r = post("/compress", {"form": "fp8"})
    assert status == 200 and r["compressed_chunks"] == 0, "nothing exact is left"


def test_keep_exact_keeps_both_and_decompress_stays_lossy(filled):
    store, post, units, _ = filled
    status, r = post("/compress", {"form": "fp8", "keep_exact": True})
    assert status == 200 and r["compressed_chunks"] == len(units)
    assert _cached(store, None) == _cached(store, "fp8") == len(PROMPT) - BS
    status, r = post("/compress", {"form": "fp8"})
    assert r["skipped"] == {"exists": len(units)}, r
    status, r = post("/decompress", {"lossy_form": "fp8"})
    assert status == 200 and r["decompressed_chunks"] == len(units)
    assert store.stats()["compressed_entries"] == 0
    assert _cached(store, "fp8") == len(PROMPT) - BS, "put back raw, still under the lossy keys"
    for u in units:  # the exact chunks are untouched
        assert store.get(u.keys[0]) != store.get(lossy_key(u.keys[0], "fp8"))


@pytest.mark.parametrize("body, status, words", [
    ({"form": "fp4"}, 400, "form="),
    ({"form": "fp8", "lossy_form": "fp8"}, 400, "leave lossy_form out"),
    ({"lossy_form": "int8"}, 400, "lossy_form="),
])
def test_bad_lossy_requests_name_the_field(filled, body, status, words):
    store, post, _, _ = filled
    got, r = post("/compress", body)
    assert got == status and words in r["error"], r
    assert store.stats()["compressed_entries"] == 0


def test_decompress_takes_no_form(filled):
    _, post, _, _ = filled
    got, r = post("/decompress", {"form": "fp8"})
    assert got == 400 and "/compress" in r["error"]


def test_fp8_needs_a_known_float_dtype(filled, cache_name):
    store, _, _, _ = filled
    ctl = Controller(load_config({"cache_name": cache_name}, env={}), store, None)
    body = json.dumps({"namespace": "ab" * 16, "form": "fp8"}).encode()  # an unregistered root: dtype unknown
    status, _, out = ctl.handle("POST", "/compress", body)
    assert status == 409 and "dtype" in json.loads(out)["error"]


def test_an_exact_worker_never_loads_a_lossy_chunk(filled):
    store, post, units, src = filled
    post("/compress", {"form": "fp8"})
    u = units[0]
    lossy = lossy_key(u.keys[0], "fp8")
    item = LoadItem("q", (lossy,), (GroupWindow(0, 4, (20, 21, 22, 23)),))  # as if a planner had asked for it
    dst = make_cache("hnd", 2, 32, BS, 2, 64, torch.bfloat16, seed=4)
    before = [t.clone() for t in dst]
    exact = KVWorker(store, KVLayout("cpu", dst, block_size=BS), 0)
    failed, _ = exact.load([item])
    assert failed == {20, 21, 22, 23} and exact.counters["load_damaged"] == 1
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, dst))
    assert same, "not a byte of the lossy chunk reached the cache"

    lossy_worker = KVWorker(store, KVLayout("cpu", dst, block_size=BS), 0, lossy_ok=True)
    failed, _ = lossy_worker.load([item])
    assert failed == set() and lossy_worker.counters["load_decoded"] == 1
    for s, d in zip(src, dst):
        err = (d[20:24].float() - s[0:4].float()).norm() / s[0:4].float().norm()
        assert 0 < float(err) < 0.05, "the loaded blocks are the fp8 form of the stored ones"


def test_lossy_chunks_spill_and_promote_under_their_own_keys(filled, tmp_path):
    from shmkv.services.maintainer import Maintainer
    from shmkv.tiers.disk.tier import DiskTier

    store, post, units, _ = filled
    post("/compress", {"form": "fp8"})
    keys = [lossy_key(u.keys[0], "fp8") for u in units]
    root = lossy_key(NS.root_key(), "fp8")
    decoded_before = {k: fmt.decode(store.get(k), k, lossy_ok=True)[0] for k in keys}
    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30, counter=store.bump)
    assert Maintainer(TierChain(store, [disk])).spill_all() == (len(keys), 0)
    store.clear()
    assert TierChain(store, [disk]).promote(keys, [root] * len(keys)) == len(keys)
    assert all(store.get(k) == decoded_before[k] for k in keys)
    assert not any(store.contains([u.keys[0] for u in units])), "nothing came back under an exact key"
    assert [k for _, _, k in chunk_keys(NS, PROMPT)] == [u.keys[0] for u in units[:3]]
