"""How a GPU copy picks its engine ("auto", the default for both directions):
by the mean contiguous run the copy issues once adjacent runs are merged,
counted by the same C++ walk the copy-engine launcher uses
(visit_token_runs). Checked here on host copies of the layouts a GPU host
meets: consecutive or fragmented block tables, token-major (NHD) or
head-major (HND) caches with 1 or 2 KV heads."""

from __future__ import annotations

import numpy as np
import torch
from kv_reference import make_cache

from shmkv.transfer.copy_backends import AUTO_DMA_MIN_RUN, choose_dma
from shmkv.transfer.layout import KVLayout

LAYERS, BLOCKS, BS, D = 4, 64, 16, 128  # head size 128, bf16: 512 bytes per K or V of one head


def runs_of(kind: str, heads: int, block_ids: list[int]) -> tuple[int, int]:
    layout = KVLayout(kind, make_cache(kind, LAYERS, BLOCKS, BS, heads, D, torch.bfloat16))
    slots = layout.slots_for_blocks(np.array(block_ids), len(block_ids) * BS)
    return layout.copier._c.token_copy_runs(slots)


def test_a_consecutive_block_table_in_a_token_major_cache_is_one_run_per_layer():
    runs, nbytes = runs_of("nhd", 8, list(range(10, 26)))
    assert runs == LAYERS
    assert nbytes == LAYERS * 16 * BS * 8 * 2 * D * 2
    assert choose_dma("store", runs, nbytes) and choose_dma("load", runs, nbytes)


def test_a_fragmented_block_table_is_one_run_per_block():
    ids = list(range(2, 64, 4))[:16]  # every fourth block, as a long-running server's free list gives
    runs, nbytes = runs_of("nhd", 8, ids)
    assert runs == LAYERS * len(ids)
    mean = nbytes // runs  # 64 KiB: one block of 16 tokens x 8 heads x 2 x 128 x bf16
    assert mean == BS * 8 * 2 * D * 2
    assert choose_dma("store", runs, nbytes), "stores overlap compute on the copy engines"
    assert not choose_dma("load", runs, nbytes), "a load the forward waits for goes to the kernel"


def test_a_head_major_cache_with_two_heads_gives_a_run_per_token_and_head():
    runs, nbytes = runs_of("hnd", 2, list(range(10, 18)))
    tokens = 8 * BS
    # the payload interleaves the heads per token: runs merge only where a block's
    # last token of head 1 meets the next block's first token of head 0
    assert runs == LAYERS * (tokens * 2 - 7)
    assert nbytes == LAYERS * tokens * 2 * 2 * D * 2
    assert not choose_dma("store", runs, nbytes) and not choose_dma("load", runs, nbytes)


def test_a_fragmented_table_of_a_one_head_cache_copies_by_kernel():
    """8 KiB runs: on an H100 a store by DMA ran at 2.1-3.5 GB/s, by the kernel at 6.5-6.8."""
    runs, nbytes = runs_of("nhd", 1, list(range(2, 64, 4))[:16])
    assert nbytes // runs == BS * 1 * 2 * D * 2
    assert not choose_dma("store", runs, nbytes) and not choose_dma("load", runs, nbytes)


def test_a_head_major_cache_with_one_head_is_token_major():
    runs, nbytes = runs_of("hnd", 1, list(range(10, 18)))
    assert runs == LAYERS and choose_dma("store", runs, nbytes)


def test_the_thresholds_split_as_documented():
    assert choose_dma("store", 1, AUTO_DMA_MIN_RUN["store"]) and not choose_dma("store", 2, AUTO_DMA_MIN_RUN["store"])
    assert not choose_dma("load", 0, 0)


def test_the_first_layer_chooses_as_every_layer_does():
    """The choice walks one layer (every layer of a layout has one geometry):
    the mean merged run of one layer is that of all, on every layout and
    block table here."""
    rng = np.random.default_rng(7)
    tables = [list(range(10, 26)), list(range(2, 64, 4))[:16], [5], list(range(60, 44, -1))]
    tables += [sorted(rng.choice(np.arange(1, BLOCKS), size=n, replace=False).tolist()) for n in (3, 8, 16, 40)]
    for kind, heads in (("nhd", 8), ("nhd", 1), ("hnd", 2), ("hnd", 1)):
        layout = KVLayout(kind, make_cache(kind, LAYERS, BLOCKS, BS, heads, D, torch.bfloat16))
        for ids in tables:
            slots = layout.slots_for_blocks(np.array(ids), len(ids) * BS)
            every, one = layout.copier._c.token_copy_runs(slots), layout.copier._c.token_copy_runs(slots, 0, 1)
            assert every == (LAYERS * one[0], LAYERS * one[1]), (kind, heads, ids)
            for direction in ("store", "load"):
                assert choose_dma(direction, *every) == choose_dma(direction, *one)
