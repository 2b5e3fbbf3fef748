"""CPU gather/scatter: exact bytes against the PyTorch reference over every
layout, dtype, block size, chunk size, partial final chunk and random block
order; and every bad input rejected before a byte moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_reference import DTYPES, make_cache, ref_gather, ref_scatter

from shmkv.errors import InvalidArgumentError
from shmkv.transfer.layout import KINDS, KVLayout

LAYERS, BLOCKS, HEADS, HEAD = 3, 12, 2, 16


def index_for(kind: str, bs: int, chunk_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Random block order; a slot mapping for token layouts (with a partial
    final block and a skipped slot)."""
    nblocks = -(-chunk_tokens // bs)
    ids = rng.permutation(BLOCKS)[:nblocks]
    if kind == "cpu":
        return ids.astype(np.int64)
    offs = np.arange(chunk_tokens)
    slots = ids[offs // bs] * bs + offs % bs
    if chunk_tokens > 3:
        slots[2] = -1
    return slots.astype(np.int64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bs", [16, 32, 128])
def test_gather_scatter_match_reference(kind, dtype, bs):
    rng = np.random.default_rng(bs)
    layers = make_cache(kind, LAYERS, BLOCKS, bs, HEADS, HEAD, dtype)
    layout = KVLayout(kind, layers)
    chunk_sizes = [bs, 3 * bs] if kind == "cpu" else [bs, 3 * bs, 2 * bs + bs // 2 + 1, 1]
    for chunk_tokens in chunk_sizes:
        idx = index_for(kind, bs, chunk_tokens, rng)
        tokens = len(idx) * bs if kind == "cpu" else len(idx)
        n = layout.payload_bytes(tokens)
        payload = torch.full((n,), 0xAB, dtype=torch.uint8)
        layout.gather(idx, payload)
        expect = ref_gather(kind, layers, torch.from_numpy(idx))
        assert torch.equal(payload, expect), f"{kind} gather of {chunk_tokens} tokens"

        # scatter new bytes into fresh blocks; compare with the reference scatter
        new = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        mine = [t.clone() for t in layers]
        theirs = [t.clone() for t in layers]
        KVLayout(kind, mine).scatter(idx, new)
        ref_scatter(kind, theirs, torch.from_numpy(idx), new)
        for a, b in zip(mine, theirs):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{kind} scatter"


def test_token_payload_is_block_size_independent():
    """The same tokens gathered from NHD caches of block size 16 and 128, and
    from a head-major view, give identical canonical payloads."""
    rng = np.random.default_rng(0)
    tokens = 300
    payloads = []
    src = torch.randint(0, 256, (LAYERS, tokens, HEADS, 2 * HEAD * 2), dtype=torch.uint8)
    for bs, kind in ((16, "nhd"), (128, "nhd"), (32, "hnd")):
        nb = -(-tokens // bs) + 2
        layers = make_cache(kind, LAYERS, nb, bs, HEADS, HEAD, torch.bfloat16)
        layout = KVLayout(kind, layers)
        ids = rng.permutation(nb)[: -(-tokens // bs)]
        slots = layout.slots_for_blocks(ids, tokens)
        layout.scatter(slots, src.reshape(-1).clone())
        out = torch.empty(layout.payload_bytes(tokens), dtype=torch.uint8)
        layout.gather(slots, out)
        payloads.append(out)
    assert torch.equal(payloads[0], src.reshape(-1))
    assert all(torch.equal(p, payloads[0]) for p in payloads)


def test_gather_into_store_and_scatter_back(cache_name):
    from shmkv import Store

    layers = make_cache("cpu", 4, 8, 128, 2, 64, torch.bfloat16)
    layout = KVLayout("cpu", layers)
    ids = np.array([5, 2], dtype=np.int64)
    with Store.create(cache_name, 16 << 20) as store:
        r = store.reserve(b"k" * 16, layout.payload_bytes(256))
        layout.gather(ids, r)
        r.commit()
        target = make_cache("cpu", 4, 8, 128, 2, 64, torch.bfloat16, seed=9)
        with store.acquire(b"k" * 16) as lease:
            KVLayout("cpu", target).scatter(np.array([0, 7]), lease)
        for a, b in zip(layers, target):
            assert torch.equal(a[5].view(torch.uint8), b[0].view(torch.uint8))
            assert torch.equal(a[2].view(torch.uint8), b[7].view(torch.uint8))


def _snapshot(layers):
    return [t.view(torch.uint8).clone() for t in layers]


@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_bad_inputs_change_nothing(kind):
    layers = make_cache(kind, 2, 4, 16, 2, 8, torch.bfloat16)
    layout = KVLayout(kind, layers)
    before = _snapshot(layers)
    good = np.array([1, 2], dtype=np.int64) if kind == "cpu" else np.arange(20, dtype=np.int64)
    n = layout.payload_bytes(32 if kind == "cpu" else 20)
    payload = torch.full((n,), 7, dtype=torch.uint8)
    bad_index = good.copy()
    bad_index[-1] = 4 if kind == "cpu" else 64  # one past the end
    cases = [
        (bad_index, payload, "out of range"),
        (good, torch.zeros(n - 1, dtype=torch.uint8), "expected"),
        (good.astype(np.float64), payload, "integers"),
        (good.reshape(1, -1), payload, "1-D"),
    ]
    if kind == "cpu":
        cases.append((np.array([-1, 2]), payload, "out of range"))
    for index, pl, msg in cases:
        with pytest.raises((InvalidArgumentError, ValueError), match=msg):
            layout.scatter(index, pl)
        with pytest.raises((InvalidArgumentError, ValueError), match=msg):
            layout.gather(index, pl.clone())
    after = _snapshot(layers)
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "nothing may be written"


def test_layout_construction_errors():
    t = torch.zeros(4, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="unknown layout"):
        KVLayout("paged", [t])
    with pytest.raises(InvalidArgumentError, match="5-D"):
        KVLayout("kv_split", [t])
    with pytest.raises(InvalidArgumentError, match="layer 1"):
        KVLayout("cpu", [t, torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)])
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        KVLayout("nhd", [torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)[..., ::2]])
    with pytest.raises(InvalidArgumentError, match="whole number"):
        KVLayout("cpu", [t]).payload_bytes(20)


def test_block_window_loads_a_sub_range_of_a_chunk():
    """A chunk of 4 blocks per layer; fill only its blocks 1..2 into the cache."""
    layers = make_cache("cpu", 3, 8, 16, 2, 8, torch.bfloat16)
    layout = KVLayout("cpu", layers)
    chunk_ids = np.array([4, 0, 6, 2], dtype=np.int64)
    payload = torch.empty(layout.payload_bytes(4 * 16), dtype=torch.uint8)
    layout.gather(chunk_ids, payload)
    target = make_cache("cpu", 3, 8, 16, 2, 8, torch.bfloat16, seed=5)
    untouched = _snapshot(target)
    KVLayout("cpu", target).scatter(np.array([7, 3]), payload, payload_first=1, payload_blocks=4)
    for src, dst, old in zip(layers, target, untouched):
        assert torch.equal(dst[7].view(torch.uint8), src[0].view(torch.uint8))
        assert torch.equal(dst[3].view(torch.uint8), src[6].view(torch.uint8))
        for b in (0, 1, 2, 4, 5, 6):
            assert torch.equal(dst[b].view(torch.uint8), old[b])
    # gather into a window writes only that window
    part = torch.full_like(payload, 0xEE)
    layout.gather(np.array([6]), part, payload_first=2, payload_blocks=4)
    per_layer = payload.numel() // 3
    block = per_layer // 4
    for li in range(3):
        seg = part[li * per_layer:(li + 1) * per_layer]
        assert torch.equal(seg[2 * block:3 * block], payload[li * per_layer + 2 * block:li * per_layer + 3 * block])
        assert bool((seg[:2 * block] == 0xEE).all()) and bool((seg[3 * block:] == 0xEE).all())
    with pytest.raises(ValueError, match="does not fit"):
        layout.scatter(np.array([1, 2]), payload, payload_first=3, payload_blocks=4)


@pytest.mark.parametrize("kind", ["cpu", "nhd"])
def test_layer_ranges_copy_only_those_layers(kind):
    layers = make_cache(kind, 4, 6, 16, 2, 8, torch.bfloat16)
    layout = KVLayout(kind, layers)
    idx = np.array([3, 1], dtype=np.int64) if kind == "cpu" else np.arange(20, 40, dtype=np.int64)
    full = torch.empty(layout.payload_bytes(32 if kind == "cpu" else 20), dtype=torch.uint8)
    layout.gather(idx, full)
    target = make_cache(kind, 4, 6, 16, 2, 8, torch.bfloat16, seed=3)
    before = _snapshot(target)
    t_layout = KVLayout(kind, target)
    t_layout.scatter(idx, full, layers=(1, 3))
    for i in range(4):
        touched = not torch.equal(target[i].view(torch.uint8), before[i])
        assert touched == (i in (1, 2))
    for a in range(4):  # layer by layer, the whole payload arrives
        t_layout.scatter(idx, full, layers=(a, a + 1))
    out = torch.empty_like(full)
    t_layout.gather(idx, out)
    assert torch.equal(out, full)
    with pytest.raises(ValueError, match="layer range"):
        layout.scatter(idx, full, layers=(2, 5))
