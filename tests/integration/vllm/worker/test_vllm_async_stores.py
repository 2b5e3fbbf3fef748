"""Stores complete asynchronously on the CPU too, through vLLM's delayed frees,
so these cases drive the protocol a GPU host runs (shmkv defaults, vLLM's
prefix cache off so every reuse comes through shmkv): a prompt under one
block and a fully cached prompt (nothing stored: never reported as finished
sending, which would kill EngineCore), 16 concurrent requests of mixed
lengths, a kv_consumer engine beside, and a second engine loading what the
first stored. Each time the engine keeps serving, greedy outputs equal the
same engine without shmkv at the same split, and every chunk loaded is
byte-equal to what was stored."""

from __future__ import annotations

import pytest
from helpers import check_loaded_bytes_equal_stored, cuda_vllm_missing, random_prompt, wait_until

from shmkv import Store

pytestmark = pytest.mark.slow

UNEXPECTED = "free was never delayed"


def log_text(engine) -> str:
    with open(engine.log_path, errors="replace") as f:
        return f.read()


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    cuda_vllm_missing() is not None, reason=cuda_vllm_missing() or "")])]


@pytest.mark.v1  # V1's own call order too (conftest: V2 runs every case, V1 these)
@pytest.mark.parametrize("device", DEVICES)
def test_delayed_frees_across_short_full_hit_concurrent_and_consumer_requests(cache_name, start_engine, reference,
                                                                              tmp_path, device):
    """On "cuda" (a GPU host with vLLM's CUDA build: `pytest -m gpu`), the same
    cases with the connector's defaults and CUDA graphs on (vLLM's default
    cudagraph_mode); outputs are then compared by the loaded KV bytes only
    (the reference engine runs eager)."""
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    # engine a keeps vLLM's own process split: the delayed-free protocol crosses EngineCore and the
    # worker as deployed; the consumer and engine b check what they load and store (EngineCore in-process)
    spec = {"llm_kwargs": {"enforce_eager": False}} if device == "cuda" else {}
    exact = device == "cpu"
    a = start_engine("a", shmkv=cfg, **spec, in_process=False)
    store = Store.attach(cache_name)
    try:
        short = random_prompt(40, seed=70)  # under one 128-token block: stores nothing
        first_short = a.generate([short])["outputs"][0]
        assert not exact or first_short == reference.output(short, 0)

        p = random_prompt(1000, seed=71)
        puts = store.stats()["puts"]
        first = a.generate([p])
        assert first["num_cached_tokens"] == [0] and (not exact or first["outputs"][0] == reference.output(p, 0))
        # 3 chunks and the 128-token tail piece, committed once their copies have run
        wait_until(lambda: store.stats()["puts"] >= puts + 4, "the 4 units of the first prompt committed")
        again = a.generate([p])  # fully cached (896 of 1,000 tokens): nothing to store
        assert again["num_cached_tokens"] == [896]
        assert not exact or again["outputs"][0] == reference.output(p, 896)

        # 16 concurrent requests of mixed lengths, half of them sharing p's prefix
        batch = [random_prompt(n, seed=100 + i) for i, n in enumerate([30, 130, 260, 700, 1100, 1500, 2100, 90])]
        batch += [p[: 300 + 74 * i] + random_prompt(200, seed=200 + i) for i in range(8)]
        r = a.generate(batch)
        assert all(len(o) == len(r["outputs"][0]) for o in r["outputs"])
        for prompt, hit, out in list(zip(batch, r["num_cached_tokens"], r["outputs"]))[::3]:
            assert not exact or out == reference.output(prompt, hit)

        # a kv_consumer engine beside: it loads, stores nothing, and is never asked to report a store
        cons = start_engine("consumer", shmkv=cfg, kv_role="kv_consumer", **spec)
        puts = store.stats()["puts"]
        c = cons.generate([p, short])
        assert c["num_cached_tokens"][0] == 896 and (not exact or c["outputs"][0] == reference.output(p, 896))
        assert store.stats()["puts"] == puts

        # a second engine loads what the first stored
        b = start_engine("b", shmkv=cfg, **spec)
        r = b.generate(batch[-4:])
        for prompt, hit, out in zip(batch[-4:], r["num_cached_tokens"], r["outputs"]):
            assert hit > 0 and (not exact or out == reference.output(prompt, hit))
        assert check_loaded_bytes_equal_stored(digests) > 0

        # every engine still serves, and no worker ever reported a request vLLM had not delayed
        assert a.generate([short])["outputs"][0] == first_short
        for e in (a, cons, b):
            assert UNEXPECTED not in log_text(e)
            assert "EngineDeadError" not in log_text(e)
        assert store.stats()["leases_held"] == 0
    finally:
        store.close()
