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
from shmkv.transfer.layout import KINDS, KVLayout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(cuda_missing() is not None, reason=cuda_missing() or "")]


@pytest.fixture
def gpu_store(cache_name):
    from shmkv.transfer import gpu

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
        idx = ids if kind == "cpu" else layout.slots_for_blocks(ids, tokens) if kind != "state" \
            else rng.permutation(12 * bs)[:tokens].astype(np.int64)  # a state per slot
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


@pytest.mark.parametrize("tokens", [400, 477, 478, 3997, 3998, 9000])
def test_a_kernel_copy_of_more_indices_than_one_launch_carries_is_exact(gpu_store, tokens):
    """The gather kernel carries the layer bases and indices in its launch
    arguments (480 words, or 4,000, a launch): copies around those bounds,
    and one that takes three launches, give the reference's bytes both ways."""
    rng = np.random.default_rng(tokens)
    blocks = -(-tokens // 16) + 3
    layers = make_cache("nhd", 3, blocks, 16, 1, 8, torch.float16, device="cuda")
    layout = KVLayout("nhd", layers)
    layout.copier.engines(store="kernel", load="kernel")
    idx = rng.permutation(blocks * 16)[:tokens].astype(np.int64)
    idx[::97] = -1  # slots outside a window: zeros in the payload, skipped by a scatter
    r = gpu_store.reserve(rng.bytes(16), layout.payload_bytes(tokens))
    layout.gather(idx, r)
    torch.cuda.synchronize()
    got = torch.frombuffer(bytearray(r.view()), dtype=torch.uint8)
    assert torch.equal(got, ref_gather("nhd", [t.cpu() for t in layers], torch.from_numpy(idx)))
    fresh = [torch.zeros_like(t) for t in layers]
    ref = [torch.zeros_like(t).cpu() for t in layers]
    target = KVLayout("nhd", fresh)
    target.copier.engines(store="kernel", load="kernel")
    target.scatter(idx, r)
    torch.cuda.synchronize()
    ref_scatter("nhd", ref, torch.from_numpy(idx), got)
    assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fresh, ref))
    r.abort()


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
    idx = layout.slots_for_blocks(rng.permutation(12)[:3].astype(np.int64), tokens) if kind != "state" \
        else rng.permutation(12 * 16)[:tokens].astype(np.int64)
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


def test_cuda_dma_on_the_legacy_default_stream_copies_by_single_memcpys(gpu_store):
    """Finding 4: CudaCopy with no stream given used the legacy default stream,
    which cudaMemcpyBatchAsync refuses: every DMA gather failed."""
    layers = make_cache("nhd", 2, 4, 16, 2, 8, torch.bfloat16, device="cuda")
    layout = KVLayout("nhd", layers)
    layout.copier.engines(store="dma", load="dma")
    idx = layout.slots_for_blocks(np.array([2, 0]), 32)
    r = gpu_store.reserve(b"d" * 16, layout.payload_bytes(32))
    layout.gather(idx, r, stream=0)
    layout.gather(idx, r)  # no stream: the current one (the legacy default stream here)
    torch.cuda.synchronize()
    got = torch.frombuffer(bytearray(r.view()), dtype=torch.uint8)
    assert torch.equal(got, ref_gather("nhd", [t.cpu() for t in layers], torch.from_numpy(idx)))
    r.abort()


@pytest.mark.parametrize("engine", ["dma", "kernel"])
def test_cuda_copies_refuse_an_unregistered_payload(gpu_store, engine):
    """Finding 10: the DMA launcher staged a pageable payload silently."""
    layers = make_cache("nhd", 2, 4, 16, 2, 8, torch.bfloat16, device="cuda")
    layout = KVLayout("nhd", layers)
    layout.copier.engines(store=engine, load=engine)
    pageable = torch.empty(layout.payload_bytes(16), dtype=torch.uint8)
    with pytest.raises(ValueError, match="not registered host memory"):
        layout.gather(layout.slots_for_blocks(np.array([0]), 16), pageable, stream=torch.cuda.Stream())


@pytest.mark.parametrize("layers", [3, 12])
def test_a_layer_read_after_wait_layer_sees_the_loaded_bytes(cache_name, layers):
    """The compute stream waits on the device for each layer's load: the load
    stream is held back (torch.cuda._sleep) before its copies, and a read
    issued on the compute stream after wait_layer still sees the loaded KV.
    With more layers than LOAD_ISSUE_AHEAD the later layers' copies are
    launched from the waits themselves."""
    from shmkv.transfer import GroupWindow, LoadItem, StoreItem, TransferEngine
    from shmkv.transfer.engine import LOAD_ISSUE_AHEAD

    store = Store.create(cache_name, 64 << 20, alignment=256)
    try:
        names = [f"l{i}" for i in range(layers)]
        src = make_cache("nhd", layers, 8, 16, 2, 64, torch.bfloat16, device="cuda", seed=1)
        dst = [torch.zeros_like(t) for t in src]
        a = TransferEngine(store, KVLayout("nhd", src, names), 0)
        b = TransferEngine(store, KVLayout("nhd", dst, names), 0)
        from shmkv.transfer import gpu

        gpu.register_segment(store)
        a.store([StoreItem("r", (b"k" * 16,), 32, (GroupWindow(0, 2, (3, 5)),))])
        b._load_stream.run(lambda s: torch.cuda._sleep(200_000_000))  # ~0.1 s of GPU time before the copies
        job = b.submit_load([LoadItem("q", (b"k" * 16,), (GroupWindow(0, 2, (1, 2)),))])
        assert len(job.events) == min(layers, LOAD_ISSUE_AHEAD)
        seen = []
        for i, name in enumerate(names):
            job.wait_layer(name)
            seen.append(dst[i][[1, 2]].clone())  # on the compute stream, after the wait
        torch.cuda.synchronize()
        for i in range(layers):
            assert torch.equal(seen[i].view(torch.uint8), src[i][[3, 5]].view(torch.uint8)), f"layer {i}"
        b.shutdown()
        a.shutdown()
        gpu.unregister_segment(store)
    finally:
        store.close()


def test_a_failed_cuda_registration_turns_the_connector_off(cache_name, monkeypatch):
    """Finding 5: cudaHostRegister ran outside register_kv_caches' error
    handling, so its failure stopped vLLM's start."""
    from shmkv.config import load_config
    from shmkv.integration.vllm.engine_inputs import KVGroup
    from shmkv.integration.vllm.worker import WorkerSide
    from shmkv.transfer import gpu

    store = Store.create(cache_name, 64 << 20, alignment=256)
    try:
        def refuse(*_):
            raise RuntimeError("cudaHostRegister: out of memory")

        monkeypatch.setattr(gpu, "register_segment", refuse)
        names = ["model.layers.0.self_attn.attn"]
        cache = torch.zeros(8, 2, 16, 128, dtype=torch.bfloat16, device="cuda")
        side = WorkerSide(load_config({"cache_name": cache_name}, env={}), store, [KVGroup(tuple(names))], 0, 16)
        side.register_kv_caches({names[0]: cache})
        assert side.worker is None and "cudaHostRegister" in side.off_reason
        side.shutdown()
    finally:
        store.close()


def test_registrations_are_counted_per_process(gpu_store):
    """A second user of the same mapping does not register it again, and the
    first to leave does not unregister it under the other (gpu_store holds one)."""
    from shmkv.transfer import gpu

    gpu.register_segment(gpu_store)
    gpu.unregister_segment(gpu_store)
    layers = make_cache("nhd", 1, 4, 16, 2, 8, torch.bfloat16, device="cuda")
    layout = KVLayout("nhd", layers)
    layout.copier.engines(store="dma", load="dma")
    r = gpu_store.reserve(b"c" * 16, layout.payload_bytes(16))
    layout.gather(layout.slots_for_blocks(np.array([1]), 16), r, stream=torch.cuda.Stream())  # still registered
    torch.cuda.synchronize()
    r.abort()


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("cpu", "state")])
@pytest.mark.parametrize("engine", ["dma", "kernel"])
def test_batched_loads_step_after_step_reuse_their_buffers_and_copy_exactly(gpu_store, kind, engine):
    """A step's loads as one batch, one launch per layer (CudaBatch), six steps
    in a row on a side stream: each step's layers are the reference's bytes
    (the copy engines' run list is built from layer 0 and shifted per layer),
    and the index buffers come from the layout's pool: after the first steps
    nothing more is allocated (no cudaMallocAsync, no pageable upload per step)."""
    rng = np.random.default_rng(11)
    src = make_cache(kind, 4, 16, 16, 2, 64, torch.bfloat16, device="cuda")
    stored = []
    for _ in range(2):  # two payloads, gathered once
        tokens = 16 + 7
        idx = KVLayout(kind, src).slots_for_blocks(rng.permutation(16)[:2].astype(np.int64), tokens)
        r = gpu_store.reserve(rng.bytes(16), KVLayout(kind, src).payload_bytes(tokens))
        KVLayout(kind, src).gather(idx, r)
        stored.append((idx, r))
    torch.cuda.synchronize()
    fresh = [torch.zeros_like(t) for t in src]
    target = KVLayout(kind, fresh)
    target.copier.engines(store=engine, load=engine)
    side = torch.cuda.Stream()
    for step in range(6):
        for t in fresh:
            t.zero_()
        torch.cuda.synchronize()
        dest = [target.slots_for_blocks(rng.permutation(16)[:2].astype(np.int64), len(idx)) for idx, _ in stored]
        batch = target.copier.batch([(d, r, {}) for d, (_, r) in zip(dest, stored)], side)
        for layer in range(len(fresh)):
            batch.copy_layer(layer, side)
        batch.release(side)
        side.synchronize()
        ref = [torch.zeros_like(t).cpu() for t in fresh]
        for d, (_, r) in zip(dest, stored):
            payload = torch.frombuffer(bytearray(r.view()), dtype=torch.uint8)
            ref_scatter(kind, ref, torch.from_numpy(d), payload)
        assert all(torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fresh, ref)), step
    assert target.copier._c.batch_buffers <= 2, "the steps reused the pool's buffers"
    for _, r in stored:
        r.abort()
