"""CUDA gather/scatter against the PyTorch reference, between a device KV
cache and payloads in a cudaHostRegister'ed shmkv segment. Runs only where a
CUDA GPU and the compiled shmkv._C_cuda are present."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import cuda_missing
from kv_reference import DTYPES, make_cache, ref_gather, ref_scatter

from shmkv import Store
from shmkv.layout import KINDS, KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_missing() is not None, reason=cuda_missing() or "")]


@pytest.fixture
def gpu_store(cache_name):
    from shmkv import gpu

    store = Store.create(cache_name, 256 << 20, alignment=256)
    gpu.register_segment(store)
    yield store
    gpu.unregister_segment(store)
    store.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bs", [16, 32, 128])
def test_cuda_gather_scatter_match_reference(gpu_store, kind, dtype, bs):
    rng = np.random.default_rng(bs)
    layers = make_cache(kind, 3, 12, bs, 2, 64, dtype, device="cuda")
    layout = KVLayout(kind, layers)
    for tokens in ([bs, 3 * bs] if kind == "cpu" else [bs, 2 * bs + bs // 2 + 1]):
        nblocks = -(-tokens // bs)
        ids = rng.permutation(12)[:nblocks].astype(np.int64)
        idx = ids if kind == "cpu" else layout.slots_for_blocks(ids, tokens)
        n = layout.payload_bytes(nblocks * bs if kind == "cpu" else tokens)
        key = rng.bytes(16)
        r = gpu_store.reserve(key, n)
        layout.gather(idx, r)
        torch.cuda.synchronize()
        got = torch.frombuffer(bytearray(r.view()), dtype=torch.uint8)
        expect = ref_gather(kind, [t.cpu() for t in layers], torch.from_numpy(idx))
        assert torch.equal(got, expect)
        r.commit()
        fresh = [torch.zeros_like(t) for t in layers]
        ref = [torch.zeros_like(t).cpu() for t in layers]
        with gpu_store.acquire(key) as lease:
            KVLayout(kind, fresh).scatter(idx, lease)
            torch.cuda.synchronize()
            ref_scatter(kind, ref, torch.from_numpy(idx), got)
        for a, b in zip(fresh, ref):
            assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


def test_cuda_bad_index_launches_nothing(gpu_store):
    layers = make_cache("nhd", 2, 4, 16, 2, 8, torch.bfloat16, device="cuda")
    before = [t.clone() for t in layers]
    layout = KVLayout("nhd", layers)
    r = gpu_store.reserve(b"b" * 16, layout.payload_bytes(4))
    with pytest.raises(ValueError, match="out of range"):
        layout.scatter(np.array([0, 1, 2, 64]), r)
    torch.cuda.synchronize()
    # compare bytes: random bf16 bits include NaNs, and NaN != NaN for torch.equal
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, layers))
    r.abort()


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "cpu"])
@pytest.mark.parametrize("engine", ["dma", "kernel"])
def test_cuda_engines_and_layer_ranges_copy_the_same_bytes(gpu_store, kind, engine):
    """The copy engines (DMA, batched) and the kernels, whole or layer by
    layer (the per-layer loads), on a side stream: the reference's bytes."""
    rng = np.random.default_rng(5)
    layers = make_cache(kind, 4, 12, 16, 2, 64, torch.bfloat16, device="cuda")
    layout = KVLayout(kind, layers)
    layout.copier.engines(store=engine, load=engine)
    tokens = 2 * 16 + 5
    idx = layout.slots_for_blocks(rng.permutation(12)[:3].astype(np.int64), tokens)
    idx[3] = -1  # a slot outside the window: zeros in the payload, skipped by a scatter
    side = torch.cuda.Stream()
    r = gpu_store.reserve(rng.bytes(16), layout.payload_bytes(tokens))
    with torch.cuda.stream(side):
        layout.gather(idx, r)
    side.synchronize()
    got = torch.frombuffer(bytearray(r.view()), dtype=torch.uint8)
    assert torch.equal(got, ref_gather(kind, [t.cpu() for t in layers], torch.from_numpy(idx)))
    fresh = [torch.zeros_like(t) for t in layers]
    ref = [torch.zeros_like(t).cpu() for t in layers]
    target = KVLayout(kind, fresh)
    target.copier.engines(store=engine, load=engine)
    with torch.cuda.stream(side):
        for layer in range(len(fresh)):
            target.scatter(idx, r, layers=(layer, layer + 1))
    side.synchronize()
    ref_scatter(kind, ref, torch.from_numpy(idx), got)
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fresh, ref))
    r.abort()


def test_cuda_dma_refuses_the_legacy_default_stream(gpu_store):
    layers = make_cache("nhd", 2, 4, 16, 2, 8, torch.bfloat16, device="cuda")
    layout = KVLayout("nhd", layers)
    layout.copier.engines(store="dma", load="dma")
    r = gpu_store.reserve(b"d" * 16, layout.payload_bytes(16))
    with pytest.raises(ValueError, match="default stream"):
        layout.gather(layout.slots_for_blocks(np.array([0]), 16), r, stream=0)
    r.abort()
