"""CPU token-mode copies merge the runs that continue on both sides (a
block's back-to-back tokens, adjacent blocks) and stream the long ones:
exact bytes against the PyTorch reference where runs cross block
boundaries, where a skipped slot or a block-order jump breaks them, at
sizes on both sides of the streaming threshold and at payload offsets that
are not 16-byte aligned (fp8, odd head sizes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_reference import make_cache, ref_gather, ref_scatter

from shmkv.transfer.layout import KVLayout

LAYERS, BLOCKS, BS = 2, 10, 16


def slot_mappings(bs: int) -> dict[str, np.ndarray]:
    def blocks(*ids: int, tokens: int | None = None) -> np.ndarray:
        offs = np.arange(len(ids) * bs if tokens is None else tokens)
        return np.asarray(ids)[offs // bs] * bs + offs % bs

    holes = blocks(2, 3, 4)
    holes[[0, bs - 1, bs, 2 * bs + 5]] = -1  # breaks at a block's first and last token, mid-block
    return {
        "adjacent blocks": blocks(3, 4, 5, 6),  # one run per layer on both sides
        "reversed blocks": blocks(6, 5, 4, 3),  # runs break at every block
        "partial last block": blocks(7, 8, tokens=bs + 5),
        "skipped slots": holes,
        "one token": blocks(9, tokens=1),
        "mid-block start": blocks(1, 2)[3:],
    }


@pytest.mark.parametrize("kind", ["nhd", "hnd", "mla", "kv_split"])
@pytest.mark.parametrize("dtype,heads,head", [(torch.bfloat16, 2, 64), (torch.float8_e4m3fn, 3, 17),
                                              (torch.float32, 1, 5), (torch.bfloat16, 4, 128)],
                         ids=["bf16-runs-256B", "fp8-odd-51B", "fp32-tiny", "bf16-runs-512B"])
def test_merged_and_streamed_runs_are_exact(kind, dtype, heads, head):
    layers = make_cache(kind, LAYERS, BLOCKS, BS, heads, head, dtype)
    layout = KVLayout(kind, layers)
    for what, slots in slot_mappings(BS).items():
        idx = slots.astype(np.int64)
        n = layout.payload_bytes(len(idx))
        payload = torch.full((n,), 0xAB, dtype=torch.uint8)
        layout.gather(idx, payload)
        assert torch.equal(payload, ref_gather(kind, layers, torch.from_numpy(idx))), f"{kind} gather, {what}"

        new = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(len(idx)))
        mine, theirs = [t.clone() for t in layers], [t.clone() for t in layers]
        KVLayout(kind, mine).scatter(idx, new)
        ref_scatter(kind, theirs, torch.from_numpy(idx), new)
        for a, b in zip(mine, theirs):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{kind} scatter, {what}"
