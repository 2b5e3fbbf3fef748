"""Which KV-cache shapes vLLM builds the connector takes, read from vLLM's own
spec classes: a group whose layers differ in shape (UniformTypeKVCacheSpecs:
a drafter of another head size in the target's group, per-layer head
counts) reads the same to the scheduler half (which vLLM hands the group's
first layer spec) and to the workers (the whole group); the shapes it cannot
restore exactly are refused with one line naming the setting. A group of
several shapes is copied per shape, byte-exact, each layer with its own."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import copy

import torch
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    UniformTypeKVCacheSpecs,
)

from shmkv import Store
from shmkv.config import load_config
from shmkv.integration.vllm.engine_inputs import KVGroup, kv_groups_of
from shmkv.integration.vllm.worker import WorkerSide
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

BS = 16


def attention(heads: int, head: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16)


def mamba(**kw) -> MambaSpec:
    return MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=(torch.bfloat16,), mamba_cache_mode="align", **kw)


def config(*groups: tuple[list[str], object], hash_block_size: int | None = None) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], hash_block_size=hash_block_size,
                         kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups])


def drafter_group() -> tuple[list[str], UniformTypeKVCacheSpecs]:
    """A target (head size 64) and a drafter (head size 32) in one group, as vLLM makes them for draft_model."""
    specs = {"model.layers.0.attn": attention(2, 64), "model.layers.1.attn": attention(2, 64),
             "draft_model.layers.0.attn": attention(2, 32)}
    return list(specs), UniformTypeKVCacheSpecs.from_specs(specs)


def test_a_group_of_several_shapes_reads_the_same_to_the_scheduler_and_the_workers():
    names, spec = drafter_group()
    assert isinstance(spec, UniformTypeKVCacheSpecs), "vLLM merges same-type layers of other shapes into one group"
    workers = config((names, spec))
    scheduler = generate_scheduler_kv_cache_config([copy.deepcopy(workers)])  # what vLLM hands the scheduler
    assert isinstance(scheduler.kv_cache_groups[0].kv_cache_spec, FullAttentionSpec)
    assert kv_groups_of(workers, BS) == kv_groups_of(scheduler, BS) == ([KVGroup(tuple(names))], None)


@pytest.mark.parametrize("groups, hash_bs, refusal", [
    pytest.param([(["a"], attention(2, 64)), (["m"], mamba(num_speculative_blocks=2))], None,
                 "2 speculative blocks per request (an EAGLE/MTP drafter on a Mamba/GDN hybrid",
                 id="hybrid_with_eagle_drafter"),
    pytest.param([(["a"], attention(2, 64)), (["m"], mamba())], BS // 2,
                 "vLLM hashes prefixes in 8-token blocks, under the 16-token block", id="sub_block_hits"),
    pytest.param([(["m"], mamba())], None,
                 "the engine's only KV-cache groups hold linear-attention state (no attention KV)",
                 id="only_state_groups"),
])
def test_shapes_shmkv_cannot_restore_are_refused_naming_the_setting(groups, hash_bs, refusal):
    got, reason = kv_groups_of(config(*groups, hash_block_size=hash_bs), BS)
    assert got == [] and reason is not None
    assert refusal in reason


def test_a_hybrid_without_a_drafter_and_with_whole_block_hashes_is_taken():
    got, reason = kv_groups_of(config((["a"], attention(2, 64)), (["m"], mamba()), hash_block_size=BS), BS)
    assert reason is None and [bool(g.state) for g in got] == [False, True]


# ------------------------------------------------ copies per layer shape ---
SHAPES = {"model.layers.0.attn": (2, 64), "draft_model.layers.0.attn": (1, 32), "model.layers.1.attn": (2, 64)}


def caches(seed: int) -> dict[str, torch.Tensor]:
    """CPU-backend views [blocks, heads, block tokens, 2*head] of each layer's own shape."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-100, 100, (8, h, BS, 2 * d), generator=g).to(torch.bfloat16)
            for n, (h, d) in SHAPES.items()}


def worker(store: Store, kv: dict[str, torch.Tensor], cache_name: str) -> WorkerSide:
    w = WorkerSide(load_config({"cache_name": cache_name}), store, [KVGroup(tuple(SHAPES))], 0, BS)
    w.register_kv_caches(kv)
    assert w.worker is not None, w.off_reason
    return w


def test_a_group_of_two_shapes_is_copied_per_shape_byte_exact(cache_name):
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        src, dst = caches(1), caches(2)
        a = worker(store, src, cache_name)
        assert a.sections == "0:2x16x128/bfloat16/2;1x16x64/bfloat16/1", "one section per shape, named"
        a.worker.store([StoreItem("r", (b"k" * 16,), 2 * BS, (GroupWindow(0, 2, (3, 5)),))])
        b = worker(store, dst, cache_name)
        failed, loaded = b.worker.load([LoadItem("q", (b"k" * 16,), (GroupWindow(0, 2, (6, 1)),))])
        assert not failed and loaded["q"][0] == 2 * BS
        for name in SHAPES:
            assert torch.equal(dst[name][[6, 1]], src[name][[3, 5]]), f"{name}: each layer with its own shape"
            assert torch.equal(dst[name][[0, 2, 3, 4, 5, 7]], caches(2)[name][[0, 2, 3, 4, 5, 7]]), name
